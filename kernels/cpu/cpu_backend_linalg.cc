// The cpu backend's dense linear algebra (OpenBLAS, LAPACKE), its
// float32 Newton-Schulz and the matrix helpers.
#include <cblas.h>
#include <lapacke.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kernels/backend.h"
#include "kernels/backend_checks.h"
#include "kernels/base/status_macros.h"
#include "kernels/cpu/cpu_backend_impl.h"
#include "kernels/cpu/gram_newton_schulz.h"

namespace canzona {
namespace cpu_internal {
namespace {

namespace checks = backend_checks;

// Debian's OpenBLAS is LP64: BLAS/LAPACK index with 32-bit integers, so a
// larger size or leading dimension would wrap. This limit is the cpu
// backend's own (cuBLAS has a 64-bit API), hence checked here rather than in
// Backend's entry points.
static_assert(sizeof(blasint) == sizeof(int32_t));
absl::Status BlasIndex(absl::string_view what, absl::string_view field,
                       int64_t value) {
  return checks::Int32Index(what, field, value, "BLAS/LAPACK");
}

// Every size and leading dimension of one GEMM shape within BLAS's range.
absl::Status BlasGemmIndices(absl::string_view what, int64_t m, int64_t n,
                             int64_t k, int64_t lda, int64_t ldb, int64_t ldc) {
  CANZONA_RETURN_IF_ERROR(BlasIndex(what, "m", m));
  CANZONA_RETURN_IF_ERROR(BlasIndex(what, "n", n));
  CANZONA_RETURN_IF_ERROR(BlasIndex(what, "k", k));
  CANZONA_RETURN_IF_ERROR(BlasIndex(what, "lda", lda));
  CANZONA_RETURN_IF_ERROR(BlasIndex(what, "ldb", ldb));
  return BlasIndex(what, "ldc", ldc);
}

CBLAS_TRANSPOSE ToCblas(Transpose t) {
  return t == Transpose::kYes ? CblasTrans : CblasNoTrans;
}

// Copies the upper triangle of the n x n matrix c onto its lower triangle.
// ssyrk writes only one triangle; the interface promises the full matrix.
void MirrorUpperToLower(int64_t n, float* c, int64_t ldc) {
  for (int64_t i = 1; i < n; ++i) {
    float* row = c + i * ldc;
    for (int64_t j = 0; j < i; ++j) row[j] = c[j * ldc + i];
  }
}

// Cache-blocked transpose: a naive loop strides through dst by `rows` floats
// per element, touching a new cache line every store.
void TransposeBlocked(int64_t rows, int64_t cols, const float* src,
                      int64_t src_ld, float* dst, int64_t dst_ld) {
  constexpr int64_t kBlock = 32;
  for (int64_t i0 = 0; i0 < rows; i0 += kBlock) {
    const int64_t i1 = std::min(rows, i0 + kBlock);
    for (int64_t j0 = 0; j0 < cols; j0 += kBlock) {
      const int64_t j1 = std::min(cols, j0 + kBlock);
      for (int64_t i = i0; i < i1; ++i) {
        for (int64_t j = j0; j < j1; ++j) {
          dst[j * dst_ld + i] = src[i * src_ld + j];
        }
      }
    }
  }
}

// Grows `v` to at least `n` elements; never shrinks, so steady-state calls
// with the same shapes do not allocate.
template <typename T>
T* Scratch(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
  return v.data();
}

}  // namespace

absl::Status CpuBackend::DoGemm(Transpose trans_a, Transpose trans_b, int64_t m,
                                int64_t n, int64_t k, float alpha,
                                const float* a, int64_t lda, const float* b,
                                int64_t ldb, float beta, float* c,
                                int64_t ldc) {
  CANZONA_RETURN_IF_ERROR(BlasGemmIndices("Gemm", m, n, k, lda, ldb, ldc));
  GemmUnchecked(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  return absl::OkStatus();
}

absl::Status CpuBackend::DoGemmStridedBatched(
    Transpose trans_a, Transpose trans_b, int64_t m, int64_t n, int64_t k,
    float alpha, const float* a, int64_t lda, int64_t stride_a, const float* b,
    int64_t ldb, int64_t stride_b, float beta, float* c, int64_t ldc,
    int64_t stride_c, int64_t batch) {
  CANZONA_RETURN_IF_ERROR(
      BlasGemmIndices("GemmStridedBatched", m, n, k, lda, ldb, ldc));
  for (int64_t i = 0; i < batch; ++i) {
    GemmUnchecked(trans_a, trans_b, m, n, k, alpha, a + i * stride_a, lda,
                  b + i * stride_b, ldb, beta, c + i * stride_c, ldc);
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::DoSyrk(Transpose trans, int64_t n, int64_t k,
                                float alpha, const float* a, int64_t lda,
                                float beta, float* c, int64_t ldc) {
  constexpr absl::string_view kWhat = "Syrk";
  CANZONA_RETURN_IF_ERROR(BlasIndex(kWhat, "n", n));
  CANZONA_RETURN_IF_ERROR(BlasIndex(kWhat, "k", k));
  CANZONA_RETURN_IF_ERROR(BlasIndex(kWhat, "lda", lda));
  CANZONA_RETURN_IF_ERROR(BlasIndex(kWhat, "ldc", ldc));
  SyrkUnchecked(trans, n, k, alpha, a, lda, beta, c, ldc);
  return absl::OkStatus();
}

absl::Status CpuBackend::DoSymmetricEigen(int64_t n, float* a,
                                          float* eigenvalues,
                                          EigenPrecision precision) {
  CANZONA_RETURN_IF_ERROR(BlasIndex("SymmetricEigen", "n", n));
  const lapack_int ln = static_cast<lapack_int>(n);
  if (precision == EigenPrecision::kFloat32) {
    const lapack_int info =
        LAPACKE_ssyevd(LAPACK_ROW_MAJOR, 'V', 'U', ln, a, ln, eigenvalues);
    CANZONA_RETURN_IF_ERROR(LapackStatus("LAPACKE_ssyevd", info));
    return EigenvaluesFinite(n, eigenvalues);
  }
  // Shampoo falls back to double when the float32 solver fails; doing the
  // whole solve in double (not just refining) is what makes that retry
  // meaningful.
  const int64_t nn = n * n;
  double* da = Scratch(eig_a_, nn);
  double* dw = Scratch(eig_w_, n);
  for (int64_t i = 0; i < nn; ++i) da[i] = a[i];
  const lapack_int info =
      LAPACKE_dsyevd(LAPACK_ROW_MAJOR, 'V', 'U', ln, da, ln, dw);
  CANZONA_RETURN_IF_ERROR(LapackStatus("LAPACKE_dsyevd", info));
  for (int64_t i = 0; i < nn; ++i) a[i] = static_cast<float>(da[i]);
  for (int64_t i = 0; i < n; ++i) eigenvalues[i] = static_cast<float>(dw[i]);
  return EigenvaluesFinite(n, eigenvalues);
}

absl::Status CpuBackend::EigenvaluesFinite(int64_t n,
                                           const float* eigenvalues) {
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(eigenvalues[i])) return NonFiniteEigenvalue();
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::DoQrOrthonormalize(int64_t rows, int64_t cols,
                                            float* a) {
  // cols <= rows, so rows bounds every index.
  CANZONA_RETURN_IF_ERROR(BlasIndex("QrOrthonormalize", "rows", rows));
  const lapack_int m = static_cast<lapack_int>(rows);
  const lapack_int n = static_cast<lapack_int>(cols);
  float* tau = Scratch(tau_, cols);
  CANZONA_RETURN_IF_ERROR(LapackStatus(
      "LAPACKE_sgeqrf", LAPACKE_sgeqrf(LAPACK_ROW_MAJOR, m, n, a, n, tau)));
  return LapackStatus("LAPACKE_sorgqr",
                      LAPACKE_sorgqr(LAPACK_ROW_MAJOR, m, n, n, a, n, tau));
}

int64_t CpuBackend::workspace_bytes() const {
  int64_t bytes = 0;
  for (const std::vector<float>* v : {&ns_x_, &ns_y_, &ns_a_, &ns_b_, &tau_}) {
    bytes += static_cast<int64_t>(v->capacity() * sizeof(float));
  }
  for (const std::vector<double>* v : {&eig_a_, &eig_w_, &col_acc_}) {
    bytes += static_cast<int64_t>(v->capacity() * sizeof(double));
  }
  bytes += static_cast<int64_t>(order_.capacity() * sizeof(int64_t));
  return bytes + gram_ws_.bytes();
}

absl::Status CpuBackend::DoReserveNewtonSchulz(const NewtonSchulzSpec& spec,
                                               int64_t /*batch*/, int64_t rows,
                                               int64_t cols) {
  // The matrices run one at a time: the workspace DoNewtonSchulz takes.
  const int64_t m = std::min(rows, cols), n = std::max(rows, cols);
  Scratch(ns_x_, m * n);
  Scratch(ns_y_, m * n);
  if (ResolvedNsAlgorithm(spec, kind(), rows, cols) == NsAlgorithm::kGram) {
    gram_ws_.Reserve(m);
  } else {
    Scratch(ns_a_, m * m);
    Scratch(ns_b_, m * m);
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::DoNewtonSchulz(const NewtonSchulzSpec& spec,
                                        int64_t batch, int64_t rows,
                                        int64_t cols, const float* input,
                                        float* output) {
  constexpr absl::string_view kWhat = "NewtonSchulz";
  CANZONA_RETURN_IF_ERROR(BlasIndex(kWhat, "rows", rows));
  CANZONA_RETURN_IF_ERROR(BlasIndex(kWhat, "cols", cols));
  const int64_t per_matrix = rows * cols;

  // Work on the wide orientation (m <= n) so X X^T is the smaller Gram
  // matrix.
  const bool transposed = rows > cols;
  const int64_t m = transposed ? cols : rows;
  const int64_t n = transposed ? rows : cols;
  // Gram (kernels/ns_algorithm.h) replaces the per-step loop below; its
  // s x s buffers are its own.
  const bool gram =
      ResolvedNsAlgorithm(spec, kind(), rows, cols) == NsAlgorithm::kGram;
  float* x = Scratch(ns_x_, m * n);
  float* y = Scratch(ns_y_, m * n);
  float* gram_xx = gram ? nullptr : Scratch(ns_a_, m * m);
  float* poly = gram ? nullptr : Scratch(ns_b_, m * m);
  const size_t x_bytes = static_cast<size_t>(m * n) * sizeof(float);

  for (int64_t i = 0; i < batch; ++i) {
    const float* in = input + i * per_matrix;
    float* out = output + i * per_matrix;
    if (transposed) {
      TransposeBlocked(rows, cols, in, cols, x, n);
    } else {
      std::memcpy(x, in, x_bytes);
    }

    double sum_squares = 0.0;
    for (int64_t j = 0; j < m * n; ++j) {
      sum_squares += static_cast<double>(x[j]) * x[j];
    }
    // Same float arithmetic as X / (norm_scale * X.norm() + eps) in torch.
    const float norm = static_cast<float>(std::sqrt(sum_squares));
    const float denom = spec.norm_scale * norm + spec.norm_eps;
    for (int64_t j = 0; j < m * n; ++j) x[j] = x[j] / denom;

    if (gram && !spec.coefficients.empty()) {
      if (cpu_internal::GramNewtonSchulz(spec, m, n, x, y, gram_ws_) == y) {
        std::swap(x, y);
      }
    }
    for (const std::array<float, 3>& abc :
         gram ? absl::Span<const std::array<float, 3>>()
              : absl::MakeConstSpan(spec.coefficients)) {
      // A = X X^T (ssyrk: half the flops of sgemm), both triangles.
      if (spec.symmetric_products) {
        SyrkUnchecked(Transpose::kNo, m, n, 1.0f, x, n, 0.0f, gram_xx, m);
      } else {
        GemmUnchecked(Transpose::kNo, Transpose::kYes, m, m, n, 1.0f, x, n, x,
                      n, 0.0f, gram_xx, m);
      }
      // B = a I + b A + c A A, so that X = B X has no "a X" term, which
      // would need a copy of X (sgemm's C must not alias its inputs); the
      // cuda backend does the same (newton_schulz.cc).
      for (int64_t r = 0; r < m; ++r) {
        for (int64_t c = 0; c < m; ++c) {
          poly[r * m + c] = abc[1] * gram_xx[r * m + c];
        }
        poly[r * m + r] += abc[0];
      }
      // A is symmetric (mirrored), so A A = A A^T: ssyrk again, half the
      // flops, onto the symmetric a I + b A, whose upper triangle it
      // updates before mirroring.
      if (spec.symmetric_products) {
        SyrkUnchecked(Transpose::kNo, m, m, abc[2], gram_xx, m, 1.0f, poly, m);
      } else {
        GemmUnchecked(Transpose::kNo, Transpose::kNo, m, m, m, abc[2], gram_xx,
                      m, gram_xx, m, 1.0f, poly, m);
      }
      GemmUnchecked(Transpose::kNo, Transpose::kNo, m, n, m, 1.0f, poly, m, x,
                    n, 0.0f, y, n);
      std::swap(x, y);
    }

    if (transposed) {
      TransposeBlocked(m, n, x, n, out, cols);
    } else {
      std::memcpy(out, x, x_bytes);
    }
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::DoAddIdentity(int64_t n, float alpha, float* a) {
  for (int64_t i = 0; i < n; ++i) a[i * n + i] += alpha;
  return absl::OkStatus();
}

absl::Status CpuBackend::DoScaleColumns(int64_t rows, int64_t cols,
                                        const float* d, float* a) {
  for (int64_t i = 0; i < rows; ++i) {
    float* row = a + i * cols;
    for (int64_t j = 0; j < cols; ++j) row[j] *= d[j];
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::DoColumnDots(int64_t rows, int64_t cols,
                                      const float* a, const float* b,
                                      float* out) {
  // Row-wise traversal keeps the reads contiguous; the per-column sums are
  // kept in double so long columns do not lose precision.
  double* acc = Scratch(col_acc_, cols);
  std::fill(acc, acc + cols, 0.0);
  for (int64_t i = 0; i < rows; ++i) {
    const float* ar = a + i * cols;
    const float* br = b + i * cols;
    for (int64_t j = 0; j < cols; ++j) {
      acc[j] += static_cast<double>(ar[j]) * br[j];
    }
  }
  for (int64_t j = 0; j < cols; ++j) out[j] = static_cast<float>(acc[j]);
  return absl::OkStatus();
}

absl::Status CpuBackend::DoSortColumns(int64_t rows, int64_t cols,
                                       const float* keys, const float* src,
                                       float* dst) {
  const std::vector<int64_t>& order = DescendingOrder(cols, keys);
  for (int64_t i = 0; i < rows; ++i) {
    const float* s = src + i * cols;
    float* d = dst + i * cols;
    for (int64_t j = 0; j < cols; ++j) d[j] = s[order[j]];
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::DoSortRows(int64_t rows, int64_t cols,
                                    const float* keys, const float* src,
                                    float* dst) {
  const std::vector<int64_t>& order = DescendingOrder(rows, keys);
  for (int64_t i = 0; i < rows; ++i) {
    std::memcpy(dst + i * cols, src + order[i] * cols,
                static_cast<size_t>(cols) * sizeof(float));
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::DoTranspose2D(int64_t rows, int64_t cols,
                                       const float* src, float* dst) {
  TransposeBlocked(rows, cols, src, cols, dst, rows);
  return absl::OkStatus();
}

const std::vector<int64_t>& CpuBackend::DescendingOrder(int64_t n,
                                                        const float* keys) {
  order_.resize(static_cast<size_t>(n));
  std::iota(order_.begin(), order_.end(), int64_t{0});
  std::stable_sort(order_.begin(), order_.end(), [keys](int64_t a, int64_t b) {
    return !std::isnan(keys[a]) && (std::isnan(keys[b]) || keys[a] > keys[b]);
  });
  return order_;
}

void CpuBackend::GemmUnchecked(Transpose trans_a, Transpose trans_b, int64_t m,
                               int64_t n, int64_t k, float alpha,
                               const float* a, int64_t lda, const float* b,
                               int64_t ldb, float beta, float* c, int64_t ldc) {
  if (k == 0) {
    ScaleByBeta(m, n, beta, c, ldc);
    return;
  }
  cblas_sgemm(CblasRowMajor, ToCblas(trans_a), ToCblas(trans_b),
              static_cast<blasint>(m), static_cast<blasint>(n),
              static_cast<blasint>(k), alpha, a, static_cast<blasint>(lda), b,
              static_cast<blasint>(ldb), beta, c, static_cast<blasint>(ldc));
}

void CpuBackend::SyrkUnchecked(Transpose trans, int64_t n, int64_t k,
                               float alpha, const float* a, int64_t lda,
                               float beta, float* c, int64_t ldc) {
  if (k == 0) {
    ScaleByBeta(n, n, beta, c, ldc);
    return;
  }
  cblas_ssyrk(CblasRowMajor, CblasUpper, ToCblas(trans),
              static_cast<blasint>(n), static_cast<blasint>(k), alpha, a,
              static_cast<blasint>(lda), beta, c, static_cast<blasint>(ldc));
  MirrorUpperToLower(n, c, ldc);
}

void CpuBackend::ScaleByBeta(int64_t rows, int64_t cols, float beta, float* c,
                             int64_t ldc) {
  for (int64_t i = 0; i < rows; ++i) {
    float* row = c + i * ldc;
    for (int64_t j = 0; j < cols; ++j) {
      row[j] = beta == 0.0f ? 0.0f : beta * row[j];
    }
  }
}

absl::Status CpuBackend::LapackStatus(absl::string_view routine,
                                      lapack_int info) {
  if (info == 0) return absl::OkStatus();
  if (info < 0) {
    // LAPACKE reports a NaN in the input matrix as an invalid argument.
    return absl::InternalError(
        absl::StrCat("cpu backend: ", routine, " failed (info=", info,
                     ": invalid argument ", -info, ", e.g. NaN in the input)"));
  }
  return absl::InternalError(absl::StrCat(
      "cpu backend: ", routine, " failed to converge (info=", info, ")"));
}

}  // namespace cpu_internal
}  // namespace canzona
