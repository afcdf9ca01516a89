// The cpu backend, method by method, against float64 references written here
// with naive loops, on fresh normal random data (fixed seeds) and shapes that
// are square, tall, wide, single-row and not multiples of the SIMD width.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/matchers/status_matchers.h"

namespace canzona {
namespace {

using ::canzona::testing::IsOk;
using ::canzona::testing::StatusIs;
using ::testing::HasSubstr;

using Matrix = std::vector<double>;  // row-major, dense

// Normal values, resampled away from exact zero so that no test passes by
// multiplying zeros.
std::vector<float> RandomNormal(int64_t n, uint32_t seed, float mean = 0.0f,
                                float stddev = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(mean, stddev);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) {
    do {
      x = dist(gen);
    } while (x == 0.0f);
  }
  return v;
}

Matrix ToDouble(const std::vector<float>& v) {
  return Matrix(v.begin(), v.end());
}

double FrobeniusNorm(const Matrix& a) {
  double s = 0.0;
  for (double x : a) s += x * x;
  return std::sqrt(s);
}

// ||a - b||_F / ||b||_F.
double RelativeError(const std::vector<float>& a, const Matrix& b) {
  double diff = 0.0, ref = 0.0;
  for (size_t i = 0; i < b.size(); ++i) {
    diff += (a[i] - b[i]) * (a[i] - b[i]);
    ref += b[i] * b[i];
  }
  return std::sqrt(diff / ref);
}

// c[m x n] = a[m x k] * b[k x n], dense, double.
Matrix MatMul(const Matrix& a, const Matrix& b, int64_t m, int64_t n,
              int64_t k) {
  Matrix c(static_cast<size_t>(m * n), 0.0);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t p = 0; p < k; ++p) {
      for (int64_t j = 0; j < n; ++j)
        c[i * n + j] += a[i * k + p] * b[p * n + j];
    }
  }
  return c;
}

Matrix TransposeOf(const Matrix& a, int64_t rows, int64_t cols) {
  Matrix t(a.size());
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) t[j * rows + i] = a[i * cols + j];
  }
  return t;
}

struct Shape {
  int64_t rows;
  int64_t cols;
};

std::string ShapeName(int64_t r, int64_t c) { return absl::StrCat(r, "x", c); }

class CpuBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_OK_AND_ASSIGN(backend_, CreateBackend(BackendKind::kCpu));
  }

  DeviceBuffer Upload(const std::vector<float>& host) {
    absl::StatusOr<DeviceBuffer> buffer =
        backend_->Allocate(static_cast<int64_t>(host.size()));
    EXPECT_THAT(buffer, IsOk());
    if (!buffer.ok()) return DeviceBuffer();
    EXPECT_THAT(
        backend_->CopyFromHost(host.data(), buffer->size(), buffer->data()),
        IsOk());
    return std::move(buffer).value();
  }

  DeviceBuffer Zeros(int64_t count) {
    absl::StatusOr<DeviceBuffer> buffer = backend_->Allocate(count);
    EXPECT_THAT(buffer, IsOk());
    return buffer.ok() ? std::move(buffer).value() : DeviceBuffer();
  }

  std::vector<float> Download(const DeviceBuffer& buffer) {
    std::vector<float> host(static_cast<size_t>(buffer.size()));
    EXPECT_THAT(backend_->CopyToHost(buffer.data(), buffer.size(), host.data()),
                IsOk());
    return host;
  }

  std::unique_ptr<Backend> backend_;
};

// ---- Memory -----------------------------------------------------------------

TEST_F(CpuBackendTest, AllocateIsZeroFilledAndAligned) {
  for (int64_t count : {1, 7, 1000, 4099}) {
    {
      // Dirty a block of the same size first so a reused block must be
      // cleared by Allocate itself.
      DeviceBuffer dirty = Zeros(count);
      ASSERT_OK(backend_->Fill(7.0f, count, dirty.data()));
    }
    ASSERT_OK_AND_ASSIGN(DeviceBuffer buffer, backend_->Allocate(count));
    EXPECT_EQ(buffer.size(), count);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(buffer.data()) % 64, 0u);
    std::vector<float> host = Download(buffer);
    EXPECT_TRUE(std::all_of(host.begin(), host.end(),
                            [](float x) { return x == 0.0f; }))
        << "count " << count;
  }
}

TEST_F(CpuBackendTest, AllocateZeroReturnsEmptyBuffer) {
  ASSERT_OK_AND_ASSIGN(DeviceBuffer buffer, backend_->Allocate(0));
  EXPECT_TRUE(buffer.empty());
  EXPECT_EQ(buffer.size(), 0);
}

TEST_F(CpuBackendTest, AllocateRejectsNegativeAndHugeCounts) {
  EXPECT_THAT(backend_->Allocate(-1),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("Allocate: count must be >= 0")));
  EXPECT_THAT(
      backend_->Allocate(std::numeric_limits<int64_t>::max()),
      StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("Allocate")));
  // 4 EiB: representable, but no machine can provide it.
  EXPECT_THAT(
      backend_->Allocate(int64_t{1} << 60),
      StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("Allocate")));
}

TEST_F(CpuBackendTest, BufferMoveTransfersOwnership) {
  ASSERT_OK_AND_ASSIGN(DeviceBuffer a, backend_->Allocate(5));
  float* data = a.data();
  DeviceBuffer b = std::move(a);
  EXPECT_EQ(b.data(), data);
  EXPECT_EQ(b.size(), 5);
  EXPECT_EQ(a.data(), nullptr);  // NOLINT(bugprone-use-after-move)
  b.Reset();
  EXPECT_TRUE(b.empty());
}

TEST_F(CpuBackendTest, CopyRoundTripsAndFills) {
  const std::vector<float> host = RandomNormal(1003, 1);
  DeviceBuffer src = Upload(host);
  DeviceBuffer dst = Zeros(1003);
  ASSERT_OK(backend_->Copy(src.data(), 1003, dst.data()));
  ASSERT_OK(backend_->Synchronize());
  EXPECT_EQ(Download(dst), host);

  ASSERT_OK(backend_->Fill(-2.5f, 1001, dst.data()));
  std::vector<float> filled = Download(dst);
  for (int64_t i = 0; i < 1001; ++i) ASSERT_EQ(filled[i], -2.5f) << i;
  EXPECT_EQ(filled[1001], host[1001]);  // past `count`: untouched
  EXPECT_EQ(filled[1002], host[1002]);
}

TEST_F(CpuBackendTest, Copy2DCopiesBlockBetweenStrides) {
  const int64_t rows = 13, cols = 5, src_ld = 9, dst_ld = 7;
  const std::vector<float> src_host = RandomNormal(rows * src_ld, 2);
  const std::vector<float> dst_host = RandomNormal(rows * dst_ld, 3);
  DeviceBuffer src = Upload(src_host);
  DeviceBuffer dst = Upload(dst_host);
  ASSERT_OK(
      backend_->Copy2D(rows, cols, src.data(), src_ld, dst.data(), dst_ld));
  std::vector<float> out = Download(dst);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < dst_ld; ++j) {
      const float expected =
          j < cols ? src_host[i * src_ld + j] : dst_host[i * dst_ld + j];
      ASSERT_EQ(out[i * dst_ld + j], expected) << i << "," << j;
    }
  }
}

// ---- Gemm / Syrk
// --------------------------------------------------------------

// The stored (rows, cols) of an operand whose op() is r x c.
Shape Stored(Transpose t, int64_t r, int64_t c) {
  return t == Transpose::kYes ? Shape{c, r} : Shape{r, c};
}

// Element (i, j) of op(x) for x stored with leading dim ld.
double OpAt(const std::vector<float>& x, int64_t ld, Transpose t, int64_t i,
            int64_t j) {
  return t == Transpose::kYes ? x[j * ld + i] : x[i * ld + j];
}

struct GemmCase {
  int64_t m, n, k;
};

const GemmCase kGemmCases[] = {{1, 7, 5},    {13, 5, 7},   {5, 13, 9},
                               {31, 31, 31}, {64, 48, 40}, {7, 1, 13},
                               {16, 16, 1},  {1, 1, 1}};

// Checks c (ldc-strided) against alpha op(a) op(b) + beta c0, and that the
// padding columns beyond n are untouched. The tolerance is the standard
// float dot-product bound, a few k * eps times the sum of |terms|.
void ExpectGemmMatches(const GemmCase& g, Transpose ta, Transpose tb,
                       float alpha, const std::vector<float>& a, int64_t lda,
                       const std::vector<float>& b, int64_t ldb, float beta,
                       const std::vector<float>& c0,
                       const std::vector<float>& c, int64_t ldc) {
  for (int64_t i = 0; i < g.m; ++i) {
    for (int64_t j = 0; j < ldc; ++j) {
      if (j >= g.n) {
        ASSERT_EQ(c[i * ldc + j], c0[i * ldc + j])
            << "padding " << i << "," << j;
        continue;
      }
      double ref = 0.0, mag = 0.0;
      for (int64_t p = 0; p < g.k; ++p) {
        const double term = OpAt(a, lda, ta, i, p) * OpAt(b, ldb, tb, p, j);
        ref += term;
        mag += std::abs(term);
      }
      ref = alpha * ref + beta * static_cast<double>(c0[i * ldc + j]);
      mag = std::abs(alpha) * mag + std::abs(beta * c0[i * ldc + j]);
      ASSERT_NEAR(c[i * ldc + j], ref, 1e-5 * mag + 1e-30) << i << "," << j;
    }
  }
}

TEST_F(CpuBackendTest, GemmMatchesReferenceAllTransposes) {
  uint32_t seed = 100;
  for (const GemmCase& g : kGemmCases) {
    for (Transpose ta : {Transpose::kNo, Transpose::kYes}) {
      for (Transpose tb : {Transpose::kNo, Transpose::kYes}) {
        SCOPED_TRACE(absl::StrCat("m=", g.m, " n=", g.n, " k=", g.k,
                                  " ta=", ta == Transpose::kYes,
                                  " tb=", tb == Transpose::kYes));
        const Shape sa = Stored(ta, g.m, g.k), sb = Stored(tb, g.k, g.n);
        // Padded leading dimensions exercise the ld arguments.
        const int64_t lda = sa.cols + 3, ldb = sb.cols + 2, ldc = g.n + 1;
        const std::vector<float> a = RandomNormal(sa.rows * lda, ++seed);
        const std::vector<float> b = RandomNormal(sb.rows * ldb, ++seed);
        const std::vector<float> c0 = RandomNormal(g.m * ldc, ++seed);
        DeviceBuffer da = Upload(a), db = Upload(b), dc = Upload(c0);
        const float alpha = 0.75f, beta = -0.5f;
        ASSERT_OK(backend_->Gemm(ta, tb, g.m, g.n, g.k, alpha, da.data(), lda,
                                 db.data(), ldb, beta, dc.data(), ldc));
        ExpectGemmMatches(g, ta, tb, alpha, a, lda, b, ldb, beta, c0,
                          Download(dc), ldc);
      }
    }
  }
}

TEST_F(CpuBackendTest, GemmWithZeroKScalesC) {
  const std::vector<float> c0 = RandomNormal(3 * 4, 7);
  DeviceBuffer dc = Upload(c0);
  ASSERT_OK(backend_->Gemm(Transpose::kNo, Transpose::kNo, 3, 4, 0, 1.0f,
                           nullptr, 1, nullptr, 4, 2.0f, dc.data(), 4));
  std::vector<float> c = Download(dc);
  for (size_t i = 0; i < c.size(); ++i) EXPECT_EQ(c[i], 2.0f * c0[i]);
}

TEST_F(CpuBackendTest, GemmStridedBatchedMatchesPerMatrixReference) {
  const GemmCase g{13, 5, 7};
  const int64_t batch = 3;
  uint32_t seed = 200;
  for (Transpose ta : {Transpose::kNo, Transpose::kYes}) {
    for (Transpose tb : {Transpose::kNo, Transpose::kYes}) {
      SCOPED_TRACE(absl::StrCat("ta=", ta == Transpose::kYes,
                                " tb=", tb == Transpose::kYes));
      const Shape sa = Stored(ta, g.m, g.k), sb = Stored(tb, g.k, g.n);
      const int64_t lda = sa.cols, ldb = sb.cols + 1, ldc = g.n;
      // Strides larger than one matrix: gaps between batch entries.
      const int64_t stride_a = sa.rows * lda + 5;
      const int64_t stride_b = sb.rows * ldb + 3;
      const int64_t stride_c = g.m * ldc + 4;
      const std::vector<float> a = RandomNormal(batch * stride_a, ++seed);
      const std::vector<float> b = RandomNormal(batch * stride_b, ++seed);
      const std::vector<float> c0 = RandomNormal(batch * stride_c, ++seed);
      DeviceBuffer da = Upload(a), db = Upload(b), dc = Upload(c0);
      ASSERT_OK(backend_->GemmStridedBatched(
          ta, tb, g.m, g.n, g.k, 1.5f, da.data(), lda, stride_a, db.data(), ldb,
          stride_b, 0.25f, dc.data(), ldc, stride_c, batch));
      const std::vector<float> c = Download(dc);
      for (int64_t i = 0; i < batch; ++i) {
        SCOPED_TRACE(absl::StrCat("batch entry ", i));
        auto slice = [](const std::vector<float>& v, int64_t start,
                        int64_t len) {
          return std::vector<float>(v.begin() + start, v.begin() + start + len);
        };
        ExpectGemmMatches(g, ta, tb, 1.5f, slice(a, i * stride_a, stride_a),
                          lda, slice(b, i * stride_b, stride_b), ldb, 0.25f,
                          slice(c0, i * stride_c, g.m * ldc),
                          slice(c, i * stride_c, g.m * ldc), ldc);
        for (int64_t j = g.m * ldc; j < stride_c; ++j) {
          EXPECT_EQ(c[i * stride_c + j], c0[i * stride_c + j]) << "gap " << j;
        }
      }
    }
  }
}

TEST_F(CpuBackendTest, SyrkWritesBothTrianglesBothTransposes) {
  const std::pair<int64_t, int64_t> cases[] = {{1, 7},  {7, 1},   {13, 5},
                                               {5, 13}, {31, 31}, {48, 64}};
  uint32_t seed = 300;
  for (const auto& [n, k] : cases) {
    for (Transpose t : {Transpose::kNo, Transpose::kYes}) {
      SCOPED_TRACE(
          absl::StrCat("n=", n, " k=", k, " trans=", t == Transpose::kYes));
      const Shape sa = Stored(t, n, k);  // op(A) = A or A^T is n x k
      const int64_t lda = sa.cols + 2, ldc = n + 3;
      const std::vector<float> a = RandomNormal(sa.rows * lda, ++seed);
      // beta != 0 needs a symmetric C.
      std::vector<float> c0 = RandomNormal(n * ldc, ++seed);
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t j = 0; j < i; ++j) c0[i * ldc + j] = c0[j * ldc + i];
      }
      DeviceBuffer da = Upload(a), dc = Upload(c0);
      const float alpha = 1.25f, beta = 0.5f;
      ASSERT_OK(
          backend_->Syrk(t, n, k, alpha, da.data(), lda, beta, dc.data(), ldc));
      const std::vector<float> c = Download(dc);
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t j = 0; j < ldc; ++j) {
          if (j >= n) {
            ASSERT_EQ(c[i * ldc + j], c0[i * ldc + j]) << "padding";
            continue;
          }
          double ref = 0.0, mag = 0.0;
          for (int64_t p = 0; p < k; ++p) {
            const double term = OpAt(a, lda, t, i, p) * OpAt(a, lda, t, j, p);
            ref += term;
            mag += std::abs(term);
          }
          ref = alpha * ref + beta * static_cast<double>(c0[i * ldc + j]);
          mag = alpha * mag + std::abs(beta * c0[i * ldc + j]);
          ASSERT_NEAR(c[i * ldc + j], ref, 1e-5 * mag) << i << "," << j;
          ASSERT_EQ(c[i * ldc + j], c[j * ldc + i]) << "not symmetric";
        }
      }
    }
  }
}

// ---- Eigen / QR
// ---------------------------------------------------------------

std::vector<float> RandomSymmetric(int64_t n, uint32_t seed) {
  std::vector<float> b = RandomNormal(n * n, seed);
  std::vector<float> s(b.size());
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      s[i * n + j] = 0.5f * (b[i * n + j] + b[j * n + i]);
    }
  }
  return s;
}

// Residual ||A Q - Q diag(lam)||_F / ||A||_F and ||Q^T Q - I||_F.
std::pair<double, double> EigenErrors(const std::vector<float>& a,
                                      const std::vector<float>& q,
                                      const std::vector<float>& lam,
                                      int64_t n) {
  const Matrix aq = MatMul(ToDouble(a), ToDouble(q), n, n, n);
  double residual = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      const double r = aq[i * n + j] - double{q[i * n + j]} * lam[j];
      residual += r * r;
    }
  }
  const Matrix qd = ToDouble(q);
  const Matrix qtq = MatMul(TransposeOf(qd, n, n), qd, n, n, n);
  double orth = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      const double r = qtq[i * n + j] - (i == j ? 1.0 : 0.0);
      orth += r * r;
    }
  }
  return {std::sqrt(residual) / FrobeniusNorm(ToDouble(a)), std::sqrt(orth)};
}

TEST_F(CpuBackendTest, SymmetricEigenBothPrecisions) {
  for (EigenPrecision precision :
       {EigenPrecision::kFloat32, EigenPrecision::kFloat64}) {
    const double tol = precision == EigenPrecision::kFloat32 ? 1e-5 : 2e-6;
    for (int64_t n : {1, 2, 7, 13, 31, 64}) {
      SCOPED_TRACE(absl::StrCat(
          "n=", n, " f64=", precision == EigenPrecision::kFloat64));
      const std::vector<float> a = RandomSymmetric(n, 400 + n);
      DeviceBuffer da = Upload(a), dw = Zeros(n);
      ASSERT_OK(backend_->SymmetricEigen(n, da.data(), dw.data(), precision));
      const std::vector<float> q = Download(da), lam = Download(dw);
      EXPECT_TRUE(std::is_sorted(lam.begin(), lam.end()));
      const auto [residual, orth] = EigenErrors(a, q, lam, n);
      EXPECT_LT(residual, tol);
      EXPECT_LT(orth, tol * std::sqrt(static_cast<double>(n)));
    }
  }
}

TEST_F(CpuBackendTest, SymmetricEigenRecoversKnownSpectrum) {
  // A = H diag(d) H with a Householder reflector H: eigenvalues d, known.
  const int64_t n = 9;
  const std::vector<float> v = RandomNormal(n, 450);
  double vv = 0.0;
  for (float x : v) vv += double{x} * x;
  const double d[n] = {3.0, -2.0, 0.5, 7.0, -4.5, 1.0, 2.5, -0.25, 5.0};
  std::vector<float> a(n * n);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double s = 0.0;
      for (int64_t p = 0; p < n; ++p) {
        const double hip = (i == p ? 1.0 : 0.0) - 2.0 * v[i] * v[p] / vv;
        const double hjp = (j == p ? 1.0 : 0.0) - 2.0 * v[j] * v[p] / vv;
        s += hip * d[p] * hjp;
      }
      a[i * n + j] = static_cast<float>(s);
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < i; ++j) a[i * n + j] = a[j * n + i];
  }
  std::vector<double> expected(d, d + n);
  std::sort(expected.begin(), expected.end());
  for (EigenPrecision precision :
       {EigenPrecision::kFloat32, EigenPrecision::kFloat64}) {
    DeviceBuffer da = Upload(a), dw = Zeros(n);
    ASSERT_OK(backend_->SymmetricEigen(n, da.data(), dw.data(), precision));
    const std::vector<float> lam = Download(dw);
    for (int64_t i = 0; i < n; ++i) EXPECT_NEAR(lam[i], expected[i], 1e-5);
  }
}

TEST_F(CpuBackendTest, SymmetricEigenNanInputIsInternalNamingRoutine) {
  std::vector<float> a = RandomSymmetric(4, 460);
  a[5] = std::numeric_limits<float>::quiet_NaN();
  DeviceBuffer da = Upload(a), dw = Zeros(4);
  EXPECT_THAT(
      backend_->SymmetricEigen(4, da.data(), dw.data(),
                               EigenPrecision::kFloat32),
      StatusIs(absl::StatusCode::kInternal, HasSubstr("LAPACKE_ssyevd")));
  da = Upload(a);
  EXPECT_THAT(
      backend_->SymmetricEigen(4, da.data(), dw.data(),
                               EigenPrecision::kFloat64),
      StatusIs(absl::StatusCode::kInternal, HasSubstr("LAPACKE_dsyevd")));
}

// Householder QR in double with LAPACK dlarfg's convention: for column j,
// beta = -sign(alpha) * ||(alpha, x)||, and H = I when x == 0 (beta = alpha).
// Returns R's diagonal (the betas).
std::vector<double> HouseholderRDiagonal(const std::vector<float>& a_in,
                                         int64_t rows, int64_t cols) {
  Matrix a = ToDouble(a_in);
  std::vector<double> diag(static_cast<size_t>(cols));
  for (int64_t j = 0; j < cols; ++j) {
    const double alpha = a[j * cols + j];
    double xnorm2 = 0.0;
    for (int64_t i = j + 1; i < rows; ++i)
      xnorm2 += a[i * cols + j] * a[i * cols + j];
    if (xnorm2 == 0.0) {
      diag[j] = alpha;
      continue;
    }
    const double beta =
        -std::copysign(std::sqrt(alpha * alpha + xnorm2), alpha);
    const double tau = (beta - alpha) / beta;
    std::vector<double> v(static_cast<size_t>(rows), 0.0);
    v[j] = 1.0;
    for (int64_t i = j + 1; i < rows; ++i)
      v[i] = a[i * cols + j] / (alpha - beta);
    for (int64_t c = j; c < cols; ++c) {
      double dot = 0.0;
      for (int64_t i = j; i < rows; ++i) dot += v[i] * a[i * cols + c];
      for (int64_t i = j; i < rows; ++i) a[i * cols + c] -= tau * v[i] * dot;
    }
    diag[j] = beta;
  }
  return diag;
}

TEST_F(CpuBackendTest, QrOrthonormalizeMatchesLapackConvention) {
  const Shape shapes[] = {{13, 5}, {64, 48}, {31, 31}, {7, 1},
                          {1, 1},  {5, 5},   {100, 3}};
  uint32_t seed = 500;
  for (const Shape& s : shapes) {
    SCOPED_TRACE(ShapeName(s.rows, s.cols));
    const int64_t m = s.rows, n = s.cols;
    const std::vector<float> a = RandomNormal(m * n, ++seed);
    DeviceBuffer da = Upload(a);
    ASSERT_OK(backend_->QrOrthonormalize(m, n, da.data()));
    const Matrix q = ToDouble(Download(da));
    const Matrix qt = TransposeOf(q, m, n);
    const Matrix qtq = MatMul(qt, q, n, n, m);
    const Matrix r = MatMul(qt, ToDouble(a), n, n, m);  // Q^T A
    const double scale = FrobeniusNorm(ToDouble(a));
    const std::vector<double> r_diag = HouseholderRDiagonal(a, m, n);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        EXPECT_NEAR(qtq[i * n + j], i == j ? 1.0 : 0.0, 1e-5)
            << "Q^T Q at " << i << "," << j;
        if (i > j) {
          EXPECT_NEAR(r[i * n + j], 0.0, 1e-5 * scale)
              << "Q^T A below diagonal at " << i << "," << j;
        }
      }
      // Same signs and magnitudes as LAPACK's Householder R.
      EXPECT_NEAR(r[i * n + i], r_diag[i], 1e-5 * scale) << "R diag " << i;
    }
  }
}

TEST_F(CpuBackendTest, QrOrthonormalizeRejectsWideMatrix) {
  DeviceBuffer da = Zeros(15);
  EXPECT_THAT(backend_->QrOrthonormalize(3, 5, da.data()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("QrOrthonormalize: rows must be >= cols")));
}

// ---- Newton-Schulz
// ------------------------------------------------------------

const std::vector<std::array<float, 3>> kSimpleSteps(5, std::array<float, 3>{
                                                            3.4445f, -4.7750f,
                                                            2.0315f});

// The same iteration in double.
Matrix NewtonSchulzReference(const NewtonSchulzSpec& spec,
                             const std::vector<float>& input, int64_t rows,
                             int64_t cols) {
  const bool transposed = rows > cols;
  const int64_t m = transposed ? cols : rows, n = transposed ? rows : cols;
  Matrix x = ToDouble(input);
  if (transposed) x = TransposeOf(x, rows, cols);
  const double denom = spec.norm_scale * FrobeniusNorm(x) + spec.norm_eps;
  for (double& e : x) e /= denom;
  for (const auto& [a, b, c] : spec.coefficients) {
    const Matrix gram = MatMul(x, TransposeOf(x, m, n), m, m, n);
    const Matrix gram2 = MatMul(gram, gram, m, m, m);
    Matrix poly(gram.size());
    for (size_t i = 0; i < poly.size(); ++i)
      poly[i] = b * gram[i] + c * gram2[i];
    const Matrix bx = MatMul(poly, x, m, n, m);
    for (size_t i = 0; i < x.size(); ++i) x[i] = a * x[i] + bx[i];
  }
  return transposed ? TransposeOf(x, m, n) : x;
}

void ExpectNewtonSchulzMatches(Backend& backend, const NewtonSchulzSpec& spec,
                               int64_t batch, int64_t rows, int64_t cols,
                               uint32_t seed, bool in_place) {
  SCOPED_TRACE(absl::StrCat("batch=", batch, " ", ShapeName(rows, cols),
                            in_place ? " in place" : ""));
  const int64_t per = rows * cols;
  // Entries of different magnitudes per matrix: the normalization must be
  // per matrix, not over the batch.
  std::vector<float> input;
  for (int64_t i = 0; i < batch; ++i) {
    std::vector<float> m = RandomNormal(per, seed + i, 0.0f, 1.0f + 3.0f * i);
    input.insert(input.end(), m.begin(), m.end());
  }
  absl::StatusOr<DeviceBuffer> in = backend.Allocate(batch * per);
  absl::StatusOr<DeviceBuffer> out = backend.Allocate(batch * per);
  ASSERT_OK(in.status());
  ASSERT_OK(out.status());
  ASSERT_OK(backend.CopyFromHost(input.data(), batch * per, in->data()));
  float* dst = in_place ? in->data() : out->data();
  ASSERT_OK(backend.NewtonSchulz(spec, batch, rows, cols, in->data(), dst));
  std::vector<float> result(static_cast<size_t>(batch * per));
  ASSERT_OK(backend.CopyToHost(dst, batch * per, result.data()));
  if (!in_place) {
    std::vector<float> unchanged(result.size());
    ASSERT_OK(backend.CopyToHost(in->data(), batch * per, unchanged.data()));
    EXPECT_EQ(unchanged, input) << "input modified";
  }
  for (int64_t i = 0; i < batch; ++i) {
    const std::vector<float> matrix(input.begin() + i * per,
                                    input.begin() + (i + 1) * per);
    const std::vector<float> got(result.begin() + i * per,
                                 result.begin() + (i + 1) * per);
    const Matrix ref = NewtonSchulzReference(spec, matrix, rows, cols);
    EXPECT_LE(RelativeError(got, ref), 1e-4) << "matrix " << i;
  }
}

TEST_F(CpuBackendTest, NewtonSchulzMatchesFloat64Reference) {
  NewtonSchulzSpec spec;
  spec.coefficients = kSimpleSteps;
  const Shape shapes[] = {{1, 7},   {7, 1},   {13, 5},  {5, 13},
                          {31, 31}, {64, 48}, {48, 64}, {3, 100}};
  uint32_t seed = 600;
  for (const Shape& s : shapes) {
    ExpectNewtonSchulzMatches(*backend_, spec, 1, s.rows, s.cols, seed += 10,
                              false);
  }
}

TEST_F(CpuBackendTest, NewtonSchulzBatchedTallAndWide) {
  NewtonSchulzSpec spec;
  spec.coefficients = kSimpleSteps;
  ExpectNewtonSchulzMatches(*backend_, spec, 3, 13, 5, 700, false);
  ExpectNewtonSchulzMatches(*backend_, spec, 3, 5, 13, 710, false);
  ExpectNewtonSchulzMatches(*backend_, spec, 4, 64, 48, 720, false);
}

TEST_F(CpuBackendTest, NewtonSchulzPerStepCoefficientsAndNormScale) {
  // Polar Express (Amsel et al.) coefficients with its 1.01 safety factor.
  NewtonSchulzSpec spec;
  spec.coefficients = {
      {8.28721201814563f, -23.595886519098837f, 17.300387312530933f},
      {4.107059111542203f, -2.9478499167379106f, 0.5448431082926601f},
      {3.9486908534822946f, -2.908902115962949f, 0.5518191394370137f},
      {3.3184196573706015f, -2.488488024314874f, 0.51004894012372f},
      {2.300652019954817f, -1.6689039845747493f, 0.4188073119525673f}};
  spec.norm_scale = 1.01f;
  spec.norm_eps = 1e-7f;
  ExpectNewtonSchulzMatches(*backend_, spec, 2, 31, 17, 800, false);
  ExpectNewtonSchulzMatches(*backend_, spec, 2, 17, 31, 810, false);
}

TEST_F(CpuBackendTest, NewtonSchulzInputMayEqualOutput) {
  NewtonSchulzSpec spec;
  spec.coefficients = kSimpleSteps;
  ExpectNewtonSchulzMatches(*backend_, spec, 2, 13, 5, 900, true);
  ExpectNewtonSchulzMatches(*backend_, spec, 2, 5, 13, 910, true);
  ExpectNewtonSchulzMatches(*backend_, spec, 1, 31, 31, 920, true);
}

TEST_F(CpuBackendTest, NewtonSchulzConvergesToPolarFactor) {
  // Independent of the reference: many classic cubic steps (1.5, -0.5, 0)
  // converge to the polar factor O = U V^T, so O has orthonormal rows (wide)
  // or columns (tall) and X O^T (wide) / O^T X (tall) is symmetric.
  NewtonSchulzSpec spec;
  spec.coefficients.assign(40, {1.5f, -0.5f, 0.0f});
  for (const Shape& s : {Shape{5, 13}, Shape{13, 5}}) {
    SCOPED_TRACE(ShapeName(s.rows, s.cols));
    const std::vector<float> x = RandomNormal(s.rows * s.cols, 950);
    DeviceBuffer dx = Upload(x), dout = Zeros(s.rows * s.cols);
    ASSERT_OK(backend_->NewtonSchulz(spec, 1, s.rows, s.cols, dx.data(),
                                     dout.data()));
    const Matrix o = ToDouble(Download(dout));
    const bool wide = s.rows <= s.cols;
    const int64_t small = wide ? s.rows : s.cols;
    const Matrix ot = TransposeOf(o, s.rows, s.cols);
    const Matrix gram = wide ? MatMul(o, ot, s.rows, s.rows, s.cols)
                             : MatMul(ot, o, s.cols, s.cols, s.rows);
    const Matrix p = wide ? MatMul(ToDouble(x), ot, s.rows, s.rows, s.cols)
                          : MatMul(ot, ToDouble(x), s.cols, s.cols, s.rows);
    for (int64_t i = 0; i < small; ++i) {
      for (int64_t j = 0; j < small; ++j) {
        EXPECT_NEAR(gram[i * small + j], i == j ? 1.0 : 0.0, 1e-4);
        EXPECT_NEAR(p[i * small + j], p[j * small + i], 1e-4);
      }
    }
  }
}

TEST_F(CpuBackendTest, NewtonSchulzBfloat16IsUnimplemented) {
  NewtonSchulzSpec spec;
  spec.coefficients = kSimpleSteps;
  spec.precision = NsPrecision::kBfloat16;
  DeviceBuffer dx = Upload(RandomNormal(20, 990));
  EXPECT_THAT(backend_->NewtonSchulz(spec, 1, 4, 5, dx.data(), dx.data()),
              StatusIs(absl::StatusCode::kUnimplemented,
                       HasSubstr("Newton-Schulz supports only float32")));
}

// ---- Elementwise
// --------------------------------------------------------------

const int64_t kSizes[] = {1, 7, 1003};

TEST_F(CpuBackendTest, LerpFollowsTorchFormula) {
  for (int64_t n : kSizes) {
    for (float w : {0.0f, 0.3f, 0.5f, 0.7f, 1.0f, -0.25f, 1.5f, -0.7f}) {
      SCOPED_TRACE(absl::StrCat("n=", n, " w=", w));
      const std::vector<float> a = RandomNormal(n, 1000 + n);
      const std::vector<float> b = RandomNormal(n, 2000 + n);
      DeviceBuffer da = Upload(a), db = Upload(b), dout = Zeros(n);
      ASSERT_OK(backend_->Lerp(n, da.data(), db.data(), w, dout.data()));
      const std::vector<float> out = Download(dout);
      for (int64_t i = 0; i < n; ++i) {
        // torch.lerp's float formula, bit for bit.
        const float diff = b[i] - a[i];
        const float torch =
            std::abs(w) < 0.5f ? a[i] + w * diff : b[i] - diff * (1.0f - w);
        ASSERT_EQ(out[i], torch) << i;
        const double ref = a[i] + double{w} * (double{b[i]} - a[i]);
        ASSERT_NEAR(out[i], ref, 1e-6 * (std::abs(a[i]) + std::abs(b[i])));
        if (w == 0.0f) {
          ASSERT_EQ(out[i], a[i]);
        }
        if (w == 1.0f) {
          ASSERT_EQ(out[i], b[i]);
        }
      }
      // Output aliasing the first input.
      ASSERT_OK(backend_->Lerp(n, da.data(), db.data(), w, da.data()));
      EXPECT_EQ(Download(da), out);
    }
  }
}

TEST_F(CpuBackendTest, AxpbyScaleEmaSquareAdamDirection) {
  for (int64_t n : kSizes) {
    SCOPED_TRACE(absl::StrCat("n=", n));
    const std::vector<float> x = RandomNormal(n, 3000 + n);
    const std::vector<float> y = RandomNormal(n, 4000 + n);
    std::vector<float> v0 = RandomNormal(n, 5000 + n);
    for (float& e : v0) e = e * e;  // second moments are positive

    DeviceBuffer dx = Upload(x), dy = Upload(y);
    ASSERT_OK(backend_->Axpby(n, 0.3f, dx.data(), -1.7f, dy.data()));
    std::vector<float> out = Download(dy);
    for (int64_t i = 0; i < n; ++i) {
      const double ref = 0.3 * x[i] + (-1.7) * double{y[i]};
      ASSERT_NEAR(out[i], ref,
                  1e-6 * (0.3 * std::abs(x[i]) + 1.7 * std::abs(y[i])));
    }

    dy = Upload(y);
    ASSERT_OK(backend_->Scale(n, -0.37f, dy.data()));
    out = Download(dy);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_NEAR(out[i], -0.37 * y[i], 1e-6 * std::abs(0.37 * y[i]));
    }

    DeviceBuffer dv = Upload(v0);
    ASSERT_OK(backend_->EmaSquare(n, 0.95f, 0.05f, dx.data(), dv.data()));
    out = Download(dv);
    for (int64_t i = 0; i < n; ++i) {
      const double ref = 0.95 * v0[i] + 0.05 * double{x[i]} * x[i];
      ASSERT_NEAR(out[i], ref, 1e-6 * ref);
    }

    DeviceBuffer dm = Upload(x), dout = Zeros(n);
    dv = Upload(v0);
    ASSERT_OK(backend_->AdamDirection(n, dm.data(), 1.25f, dv.data(), 3.0f,
                                      1e-3f, dout.data()));
    out = Download(dout);
    for (int64_t i = 0; i < n; ++i) {
      const double ref = 1.25 * x[i] / (std::sqrt(3.0 * v0[i]) + double{1e-3f});
      ASSERT_NEAR(out[i], ref, 1e-6 * std::abs(ref));
    }
  }
}

struct AdamWConfig {
  float lr, beta1, beta2, eps, weight_decay;
};

// torch.optim.AdamW's single-tensor step in float64, same operation order.
// `mag` carries, per state value, the same recurrence on absolute values: the
// scale that float rounding errors are relative to when terms cancel.
struct AdamWState {
  double p, m, v;
};
void AdamWReference(const AdamWConfig& c, int64_t step, double g, AdamWState& s,
                    AdamWState& mag) {
  const double decay = 1.0 - double{c.lr} * c.weight_decay;
  s.p *= decay;
  mag.p *= decay;
  s.m = s.m + (1.0 - c.beta1) * (g - s.m);
  mag.m = c.beta1 * mag.m + (1.0 - c.beta1) * std::abs(g);
  s.v = s.v * c.beta2 + (1.0 - c.beta2) * g * g;
  mag.v = s.v;
  const double bc1 = 1.0 - std::pow(double{c.beta1}, step);
  const double bc2 = 1.0 - std::pow(double{c.beta2}, step);
  const double step_size = c.lr / bc1;
  const double denom = std::sqrt(s.v) / std::sqrt(bc2) + c.eps;
  s.p -= step_size * s.m / denom;
  mag.p += step_size * mag.m / denom;
}

TEST_F(CpuBackendTest, AdamWStepMatchesTorchOrderReference) {
  // Default betas, and beta1 < 0.5 (lerp takes its large-weight branch).
  const AdamWConfig configs[] = {{1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f},
                                 {3e-2f, 0.3f, 0.95f, 1e-6f, 0.1f}};
  const int64_t n = 1003;
  for (const AdamWConfig& c : configs) {
    SCOPED_TRACE(absl::StrCat("lr=", c.lr, " beta1=", c.beta1));
    const std::vector<float> p0 = RandomNormal(n, 6000);
    std::vector<AdamWState> ref(n), mag(n);
    for (int64_t i = 0; i < n; ++i) {
      ref[i] = {p0[i], 0.0, 0.0};
      mag[i] = {std::abs(p0[i]), 0.0, 0.0};
    }
    DeviceBuffer dp = Upload(p0), dm = Zeros(n), dv = Zeros(n);
    for (int64_t step = 1; step <= 10; ++step) {
      const std::vector<float> g = RandomNormal(n, 6000 + step);
      DeviceBuffer dg = Upload(g);
      ASSERT_OK(backend_->AdamWStep(n, c.lr, c.beta1, c.beta2, c.eps,
                                    c.weight_decay, step, dg.data(), dp.data(),
                                    dm.data(), dv.data()));
      for (int64_t i = 0; i < n; ++i) {
        AdamWReference(c, step, g[i], ref[i], mag[i]);
      }
    }
    const std::vector<float> got_p = Download(dp), got_m = Download(dm),
                             got_v = Download(dv);
    for (int64_t i = 0; i < n; ++i) {
      // 1e-6 relative to the magnitude of the terms that were summed (equal
      // to |value| unless terms cancelled).
      ASSERT_NEAR(got_p[i], ref[i].p, 1e-6 * mag[i].p) << i;
      ASSERT_NEAR(got_m[i], ref[i].m, 1e-6 * mag[i].m) << i;
      ASSERT_NEAR(got_v[i], ref[i].v, 1e-6 * mag[i].v) << i;
    }
  }
}

TEST_F(CpuBackendTest, AdamWStepRoundsScalarsLikeTorch) {
  // torch evaluates the scalars as Python floats (double) and rounds each to
  // float32 against the tensor; the float arithmetic that follows is then
  // fixed, so one step must match this emulation bit for bit.
  const float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, wd = 0.01f;
  const int64_t step = 3, n = 257;
  const std::vector<float> g = RandomNormal(n, 6100);
  const std::vector<float> p0 = RandomNormal(n, 6101);
  const std::vector<float> m0 = RandomNormal(n, 6102, 0.0f, 0.1f);
  std::vector<float> v0 = RandomNormal(n, 6103, 0.0f, 0.1f);
  for (float& e : v0) e = e * e;
  DeviceBuffer dg = Upload(g), dp = Upload(p0), dm = Upload(m0),
               dv = Upload(v0);
  ASSERT_OK(backend_->AdamWStep(n, lr, beta1, beta2, eps, wd, step, dg.data(),
                                dp.data(), dm.data(), dv.data()));
  const std::vector<float> p = Download(dp), m = Download(dm), v = Download(dv);
  const float decay = static_cast<float>(1.0 - double{lr} * wd);
  const float w1 = static_cast<float>(1.0 - double{beta1});
  const float w2 = static_cast<float>(1.0 - double{beta2});
  const double bc1 = 1.0 - std::pow(double{beta1}, 3.0);
  const double bc2 = 1.0 - std::pow(double{beta2}, 3.0);
  const float neg_step = static_cast<float>(-(double{lr} / bc1));
  const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  for (int64_t i = 0; i < n; ++i) {
    const float pi = p0[i] * decay;
    const float mi = m0[i] + w1 * (g[i] - m0[i]);
    const float vi = v0[i] * beta2 + w2 * g[i] * g[i];
    const float denom = std::sqrt(vi) / bc2_sqrt + eps;
    ASSERT_EQ(m[i], mi) << i;
    ASSERT_EQ(v[i], vi) << i;
    ASSERT_EQ(p[i], pi + neg_step * mi / denom) << i;
  }
}

TEST_F(CpuBackendTest, SumSquaresAccumulatesInDouble) {
  // 2^20 values near 1: a float accumulator would be off by ~1e-4 relative.
  const int64_t n = (int64_t{1} << 20) + 3;
  const std::vector<float> x = RandomNormal(n, 7000, 1.0f, 0.5f);
  long double ref = 0.0L;
  for (float e : x) ref += static_cast<long double>(e) * e;
  DeviceBuffer dx = Upload(x);
  ASSERT_OK_AND_ASSIGN(double got, backend_->SumSquares(n, dx.data()));
  EXPECT_NEAR(got, static_cast<double>(ref), 1e-12 * static_cast<double>(ref));
  for (int64_t small : {0, 1, 7}) {
    double r = 0.0;
    for (int64_t i = 0; i < small; ++i) r += double{x[i]} * x[i];
    ASSERT_OK_AND_ASSIGN(double s, backend_->SumSquares(small, dx.data()));
    EXPECT_DOUBLE_EQ(s, r) << small;
  }
}

TEST_F(CpuBackendTest, AllFiniteDetectsNanAndInfAnywhere) {
  const int64_t n = 1003;
  const std::vector<float> x = RandomNormal(n, 7100, 0.0f, 1e30f);
  DeviceBuffer dx = Upload(x);
  ASSERT_OK_AND_ASSIGN(bool finite, backend_->AllFinite(n, dx.data()));
  EXPECT_TRUE(finite);
  ASSERT_OK_AND_ASSIGN(bool empty, backend_->AllFinite(0, nullptr));
  EXPECT_TRUE(empty);
  for (float bad : {std::numeric_limits<float>::quiet_NaN(),
                    std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    for (int64_t pos : {int64_t{0}, int64_t{500}, n - 1}) {
      std::vector<float> y = x;
      y[pos] = bad;
      DeviceBuffer dy = Upload(y);
      ASSERT_OK_AND_ASSIGN(bool ok, backend_->AllFinite(n, dy.data()));
      EXPECT_FALSE(ok) << bad << " at " << pos;
    }
  }
}

// ---- Matrix helpers
// -----------------------------------------------------------

TEST_F(CpuBackendTest, AddIdentityTouchesOnlyDiagonal) {
  for (int64_t n : {1, 7, 31}) {
    const std::vector<float> a = RandomNormal(n * n, 8000 + n);
    DeviceBuffer da = Upload(a);
    ASSERT_OK(backend_->AddIdentity(n, 0.75f, da.data()));
    const std::vector<float> out = Download(da);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        ASSERT_EQ(out[i * n + j], i == j ? a[i * n + j] + 0.75f : a[i * n + j]);
      }
    }
  }
}

TEST_F(CpuBackendTest, ScaleColumnsAndColumnDots) {
  const Shape shapes[] = {{1, 7}, {13, 5}, {5, 13}, {64, 48}};
  for (const Shape& s : shapes) {
    SCOPED_TRACE(ShapeName(s.rows, s.cols));
    const std::vector<float> a = RandomNormal(s.rows * s.cols, 8100);
    const std::vector<float> b = RandomNormal(s.rows * s.cols, 8101);
    const std::vector<float> d = RandomNormal(s.cols, 8102);
    DeviceBuffer da = Upload(a), db = Upload(b), dd = Upload(d),
                 dout = Zeros(s.cols);
    ASSERT_OK(backend_->ColumnDots(s.rows, s.cols, da.data(), db.data(),
                                   dout.data()));
    const std::vector<float> dots = Download(dout);
    for (int64_t j = 0; j < s.cols; ++j) {
      double ref = 0.0, mag = 0.0;
      for (int64_t i = 0; i < s.rows; ++i) {
        ref += double{a[i * s.cols + j]} * b[i * s.cols + j];
        mag += std::abs(double{a[i * s.cols + j]} * b[i * s.cols + j]);
      }
      ASSERT_NEAR(dots[j], ref, 1e-6 * mag) << j;
    }
    ASSERT_OK(backend_->ScaleColumns(s.rows, s.cols, dd.data(), da.data()));
    const std::vector<float> scaled = Download(da);
    for (int64_t i = 0; i < s.rows; ++i) {
      for (int64_t j = 0; j < s.cols; ++j) {
        ASSERT_EQ(scaled[i * s.cols + j], a[i * s.cols + j] * d[j]);
      }
    }
  }
}

std::vector<int64_t> RandomPermutation(int64_t n, uint32_t seed) {
  std::vector<int64_t> perm(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) perm[i] = i;
  std::mt19937 gen(seed);
  std::shuffle(perm.begin(), perm.end(), gen);
  return perm;
}

TEST_F(CpuBackendTest, GatherColumnsAndRows) {
  const Shape shapes[] = {{1, 7}, {7, 1}, {13, 5}, {5, 13}, {31, 31}};
  for (const Shape& s : shapes) {
    SCOPED_TRACE(ShapeName(s.rows, s.cols));
    const std::vector<float> src = RandomNormal(s.rows * s.cols, 8200);
    DeviceBuffer dsrc = Upload(src), ddst = Zeros(s.rows * s.cols);
    const std::vector<int64_t> col_perm = RandomPermutation(s.cols, 8201);
    ASSERT_OK(backend_->GatherColumns(s.rows, s.cols, col_perm, dsrc.data(),
                                      ddst.data()));
    std::vector<float> out = Download(ddst);
    for (int64_t i = 0; i < s.rows; ++i) {
      for (int64_t j = 0; j < s.cols; ++j) {
        ASSERT_EQ(out[i * s.cols + j], src[i * s.cols + col_perm[j]]);
      }
    }
    const std::vector<int64_t> row_perm = RandomPermutation(s.rows, 8202);
    ASSERT_OK(backend_->GatherRows(s.rows, s.cols, row_perm, dsrc.data(),
                                   ddst.data()));
    out = Download(ddst);
    for (int64_t i = 0; i < s.rows; ++i) {
      for (int64_t j = 0; j < s.cols; ++j) {
        ASSERT_EQ(out[i * s.cols + j], src[row_perm[i] * s.cols + j]);
      }
    }
  }
}

TEST_F(CpuBackendTest, Transpose2DAcrossBlockBoundaries) {
  const Shape shapes[] = {{1, 7}, {7, 1}, {33, 65}, {64, 48}, {31, 31}};
  for (const Shape& s : shapes) {
    SCOPED_TRACE(ShapeName(s.rows, s.cols));
    const std::vector<float> src = RandomNormal(s.rows * s.cols, 8300);
    DeviceBuffer dsrc = Upload(src), ddst = Zeros(s.rows * s.cols);
    ASSERT_OK(backend_->Transpose2D(s.rows, s.cols, dsrc.data(), ddst.data()));
    const std::vector<float> out = Download(ddst);
    for (int64_t i = 0; i < s.rows; ++i) {
      for (int64_t j = 0; j < s.cols; ++j) {
        ASSERT_EQ(out[j * s.rows + i], src[i * s.cols + j]);
      }
    }
  }
}

// ---- Argument validation
// ------------------------------------------------------

struct ErrorCase {
  std::string name;
  std::function<absl::Status(Backend&)> call;
  std::string message;  // expected substring
};

TEST_F(CpuBackendTest, InvalidArgumentsNameMethodAndField) {
  ASSERT_OK_AND_ASSIGN(DeviceBuffer buf, backend_->Allocate(64));
  float* p = buf.data();
  const Transpose kN = Transpose::kNo, kT = Transpose::kYes;
  const std::vector<int64_t> dup = {0, 1, 1, 3};
  const std::vector<int64_t> out_of_range = {0, 1, 2, 4};
  const std::vector<int64_t> short_perm = {0, 1, 2};
  NewtonSchulzSpec spec;
  spec.coefficients = kSimpleSteps;
  const std::vector<ErrorCase> cases = {
      {"copy negative", [&](Backend& b) { return b.Copy(p, -1, p); },
       "Copy: count must be >= 0"},
      {"copy null", [&](Backend& b) { return b.Copy(nullptr, 4, p); },
       "Copy: src is null for 4 elements"},
      {"from host null",
       [&](Backend& b) { return b.CopyFromHost(p, 4, nullptr); },
       "CopyFromHost: dst is null"},
      {"to host negative", [&](Backend& b) { return b.CopyToHost(p, -2, p); },
       "CopyToHost: count must be >= 0"},
      {"copy2d ld", [&](Backend& b) { return b.Copy2D(2, 5, p, 5, p + 32, 4); },
       "Copy2D: dst_ld = 4 is smaller than the row length 5"},
      {"fill null", [&](Backend& b) { return b.Fill(1.0f, 3, nullptr); },
       "Fill: dst is null"},
      {"gemm m",
       [&](Backend& b) {
         return b.Gemm(kN, kN, -1, 2, 2, 1, p, 2, p, 2, 0, p, 2);
       },
       "Gemm: m must be >= 0"},
      {"gemm k",
       [&](Backend& b) {
         return b.Gemm(kN, kN, 2, 2, -3, 1, p, 2, p, 2, 0, p, 2);
       },
       "Gemm: k must be >= 0"},
      {"gemm null a",
       [&](Backend& b) {
         return b.Gemm(kN, kN, 2, 2, 2, 1, nullptr, 2, p, 2, 0, p, 2);
       },
       "Gemm: a is null"},
      {"gemm lda",
       [&](Backend& b) {
         return b.Gemm(kN, kN, 2, 2, 5, 1, p, 3, p, 2, 0, p, 2);
       },
       "Gemm: lda = 3 is smaller than the row length 5"},
      {"gemm lda transposed",  // A^T stored k x m = 2 x 6
       [&](Backend& b) {
         return b.Gemm(kT, kN, 6, 2, 2, 1, p, 2, p, 2, 0, p + 32, 2);
       },
       "Gemm: lda = 2 is smaller than the row length 6"},
      {"gemm ldb transposed",  // B^T stored n x k = 3 x 4
       [&](Backend& b) {
         return b.Gemm(kN, kT, 2, 3, 4, 1, p, 4, p, 3, 0, p + 32, 3);
       },
       "Gemm: ldb = 3 is smaller than the row length 4"},
      {"gemm ldc",
       [&](Backend& b) {
         return b.Gemm(kN, kN, 2, 4, 2, 1, p, 2, p, 4, 0, p + 32, 3);
       },
       "Gemm: ldc = 3 is smaller than the row length 4"},
      {"batched batch",
       [&](Backend& b) {
         return b.GemmStridedBatched(kN, kN, 2, 2, 2, 1, p, 2, 4, p, 2, 4, 0, p,
                                     2, 4, -1);
       },
       "GemmStridedBatched: batch must be >= 0"},
      {"batched stride",
       [&](Backend& b) {
         return b.GemmStridedBatched(kN, kN, 2, 2, 2, 1, p, 2, 4, p, 2, -4, 0,
                                     p, 2, 4, 2);
       },
       "GemmStridedBatched: stride_b must be >= 0"},
      {"batched null c",
       [&](Backend& b) {
         return b.GemmStridedBatched(kN, kN, 2, 2, 2, 1, p, 2, 4, p, 2, 4, 0,
                                     nullptr, 2, 4, 2);
       },
       "GemmStridedBatched: c is null"},
      {"syrk n",
       [&](Backend& b) { return b.Syrk(kN, -1, 2, 1, p, 2, 0, p, 2); },
       "Syrk: n must be >= 0"},
      {"syrk lda transposed",  // A stored k x n = 3 x 4
       [&](Backend& b) { return b.Syrk(kT, 4, 3, 1, p, 3, 0, p + 32, 4); },
       "Syrk: lda = 3 is smaller than the row length 4"},
      {"syrk ldc",
       [&](Backend& b) { return b.Syrk(kN, 4, 3, 1, p, 3, 0, p + 32, 2); },
       "Syrk: ldc = 2 is smaller than the row length 4"},
      {"eigen n",
       [&](Backend& b) {
         return b.SymmetricEigen(-1, p, p, EigenPrecision::kFloat32);
       },
       "SymmetricEigen: n must be >= 0"},
      {"eigen null values",
       [&](Backend& b) {
         return b.SymmetricEigen(3, p, nullptr, EigenPrecision::kFloat64);
       },
       "SymmetricEigen: eigenvalues is null"},
      {"qr rows", [&](Backend& b) { return b.QrOrthonormalize(-1, 2, p); },
       "QrOrthonormalize: rows must be >= 0"},
      {"qr null", [&](Backend& b) { return b.QrOrthonormalize(3, 2, nullptr); },
       "QrOrthonormalize: a is null"},
      {"ns batch",
       [&](Backend& b) { return b.NewtonSchulz(spec, -1, 2, 2, p, p); },
       "NewtonSchulz: batch must be >= 0"},
      {"ns cols",
       [&](Backend& b) { return b.NewtonSchulz(spec, 1, 2, -2, p, p); },
       "NewtonSchulz: cols must be >= 0"},
      {"ns null output",
       [&](Backend& b) { return b.NewtonSchulz(spec, 2, 2, 2, p, nullptr); },
       "NewtonSchulz: output is null for 8 elements"},
      {"lerp n", [&](Backend& b) { return b.Lerp(-1, p, p, 0.5f, p); },
       "Lerp: n must be >= 0"},
      {"lerp null out",
       [&](Backend& b) { return b.Lerp(3, p, p, 0.5f, nullptr); },
       "Lerp: out is null"},
      {"axpby null x", [&](Backend& b) { return b.Axpby(3, 1, nullptr, 1, p); },
       "Axpby: x is null"},
      {"scale n", [&](Backend& b) { return b.Scale(-5, 1, p); },
       "Scale: n must be >= 0"},
      {"ema null v",
       [&](Backend& b) { return b.EmaSquare(3, 0.9f, 0.1f, p, nullptr); },
       "EmaSquare: v is null"},
      {"adam direction null m",
       [&](Backend& b) {
         return b.AdamDirection(3, nullptr, 1, p, 1, 1e-8f, p);
       },
       "AdamDirection: m is null"},
      {"adamw n",
       [&](Backend& b) {
         return b.AdamWStep(-1, 1e-3f, 0.9f, 0.999f, 1e-8f, 0, 1, p, p, p, p);
       },
       "AdamWStep: n must be >= 0"},
      {"adamw null v",
       [&](Backend& b) {
         return b.AdamWStep(3, 1e-3f, 0.9f, 0.999f, 1e-8f, 0, 1, p, p, p,
                            nullptr);
       },
       "AdamWStep: v is null"},
      {"adamw step",
       [&](Backend& b) {
         return b.AdamWStep(3, 1e-3f, 0.9f, 0.999f, 1e-8f, 0, 0, p, p, p, p);
       },
       "AdamWStep: step must be >= 1, got 0"},
      {"sum squares n",
       [&](Backend& b) { return b.SumSquares(-1, p).status(); },
       "SumSquares: n must be >= 0"},
      {"all finite null",
       [&](Backend& b) { return b.AllFinite(2, nullptr).status(); },
       "AllFinite: x is null"},
      {"add identity n", [&](Backend& b) { return b.AddIdentity(-1, 1, p); },
       "AddIdentity: n must be >= 0"},
      {"scale columns null d",
       [&](Backend& b) { return b.ScaleColumns(2, 3, nullptr, p); },
       "ScaleColumns: d is null"},
      {"column dots null out",
       [&](Backend& b) { return b.ColumnDots(2, 3, p, p, nullptr); },
       "ColumnDots: out is null"},
      {"gather columns duplicate",
       [&](Backend& b) { return b.GatherColumns(2, 4, dup, p, p + 32); },
       "GatherColumns: perm is not a permutation of [0, 4)"},
      {"gather columns out of range",
       [&](Backend& b) {
         return b.GatherColumns(2, 4, out_of_range, p, p + 32);
       },
       "GatherColumns: perm is not a permutation of [0, 4)"},
      {"gather columns size",
       [&](Backend& b) { return b.GatherColumns(2, 4, short_perm, p, p + 32); },
       "GatherColumns: perm has 3 entries, expected 4"},
      {"gather rows duplicate",
       [&](Backend& b) { return b.GatherRows(4, 2, dup, p, p + 32); },
       "GatherRows: perm is not a permutation of [0, 4)"},
      {"gather rows negative",
       [&](Backend& b) { return b.GatherRows(-4, 2, dup, p, p + 32); },
       "GatherRows: rows must be >= 0"},
      {"transpose null dst",
       [&](Backend& b) { return b.Transpose2D(2, 3, p, nullptr); },
       "Transpose2D: dst is null"},
  };
  for (const ErrorCase& c : cases) {
    EXPECT_THAT(c.call(*backend_), StatusIs(absl::StatusCode::kInvalidArgument,
                                            HasSubstr(c.message)))
        << c.name;
  }
}

TEST_F(CpuBackendTest, ZeroSizeCallsAreNoOps) {
  NewtonSchulzSpec spec;
  spec.coefficients = kSimpleSteps;
  const Transpose kN = Transpose::kNo;
  Backend& b = *backend_;
  EXPECT_OK(b.Copy(nullptr, 0, nullptr));
  EXPECT_OK(b.CopyFromHost(nullptr, 0, nullptr));
  EXPECT_OK(b.CopyToHost(nullptr, 0, nullptr));
  EXPECT_OK(b.Copy2D(0, 5, nullptr, 5, nullptr, 5));
  EXPECT_OK(b.Fill(1.0f, 0, nullptr));
  EXPECT_OK(b.Gemm(kN, kN, 0, 0, 0, 1, nullptr, 1, nullptr, 1, 0, nullptr, 1));
  EXPECT_OK(b.Gemm(kN, kN, 0, 3, 0, 1, nullptr, 1, nullptr, 3, 0, nullptr, 3));
  EXPECT_OK(b.GemmStridedBatched(kN, kN, 2, 2, 2, 1, nullptr, 2, 4, nullptr, 2,
                                 4, 0, nullptr, 2, 4, 0));
  EXPECT_OK(b.Syrk(kN, 0, 4, 1, nullptr, 4, 0, nullptr, 1));
  EXPECT_OK(b.SymmetricEigen(0, nullptr, nullptr, EigenPrecision::kFloat32));
  EXPECT_OK(b.QrOrthonormalize(0, 0, nullptr));
  EXPECT_OK(b.QrOrthonormalize(5, 0, nullptr));
  EXPECT_OK(b.NewtonSchulz(spec, 0, 4, 4, nullptr, nullptr));
  EXPECT_OK(b.NewtonSchulz(spec, 3, 0, 4, nullptr, nullptr));
  EXPECT_OK(b.Lerp(0, nullptr, nullptr, 0.5f, nullptr));
  EXPECT_OK(b.Axpby(0, 1, nullptr, 1, nullptr));
  EXPECT_OK(b.Scale(0, 1, nullptr));
  EXPECT_OK(b.EmaSquare(0, 1, 1, nullptr, nullptr));
  EXPECT_OK(b.AdamDirection(0, nullptr, 1, nullptr, 1, 1, nullptr));
  EXPECT_OK(b.AdamWStep(0, 1e-3f, 0.9f, 0.999f, 1e-8f, 0, 1, nullptr, nullptr,
                        nullptr, nullptr));
  EXPECT_THAT(b.SumSquares(0, nullptr), IsOk());
  EXPECT_OK(b.AddIdentity(0, 1, nullptr));
  EXPECT_OK(b.ScaleColumns(0, 0, nullptr, nullptr));
  EXPECT_OK(b.ColumnDots(0, 0, nullptr, nullptr, nullptr));
  EXPECT_OK(b.GatherColumns(0, 0, {}, nullptr, nullptr));
  EXPECT_OK(b.GatherRows(0, 0, {}, nullptr, nullptr));
  EXPECT_OK(b.Transpose2D(0, 7, nullptr, nullptr));
  EXPECT_OK(b.Synchronize());
}

}  // namespace
}  // namespace canzona
