// Conformance: GEMM, SYRK, the symmetric eigendecomposition, QR and
// Newton-Schulz against float64 references, on square, tall, wide, single
// row/column and odd shapes with padded leading dimensions.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/kernels/backend_conformance.h"
#include "tests/unit/kernels/backend_reference.h"

namespace canzona {
namespace {

using ::canzona::backend_reference::EigenErrors;
using ::canzona::backend_reference::FrobeniusNorm;
using ::canzona::backend_reference::HouseholderRDiagonal;
using ::canzona::backend_reference::MatMul;
using ::canzona::backend_reference::Matrix;
using ::canzona::backend_reference::NewtonSchulzReference;
using ::canzona::backend_reference::OpAt;
using ::canzona::backend_reference::QuinticSpec;
using ::canzona::backend_reference::RandomNormal;
using ::canzona::backend_reference::RandomSymmetric;
using ::canzona::backend_reference::RelativeError;
using ::canzona::backend_reference::Shape;
using ::canzona::backend_reference::ShapeName;
using ::canzona::backend_reference::Stored;
using ::canzona::backend_reference::ToDouble;
using ::canzona::backend_reference::TransposeOf;

// ---- Gemm / Syrk
// --------------------------------------------------------------

// A float32 dot product of k terms, summed in any order with or without
// fused multiply-adds, is within k * 2^-24 of the sum of |terms|; alpha,
// beta and the final add cost a few more roundings. Any correct float32
// GEMM meets this, whatever its blocking; a TF32 or bf16 shortcut does not.
double GemmBound(int64_t k, double magnitude) {
  return (static_cast<double>(k) + 4.0) * std::ldexp(1.0, -24) * magnitude +
         1e-30;
}

struct GemmCase {
  int64_t m, n, k;
};

// Small odd shapes, then larger ones that cross the GPU libraries' tile
// sizes (k = m + n / 2 + 3).
const GemmCase kGemmCases[] = {
    {1, 7, 5},      {13, 5, 7},    {5, 13, 9},     {31, 31, 31}, {64, 48, 40},
    {7, 1, 13},     {16, 16, 1},   {1, 1, 1},      {64, 64, 99}, {37, 53, 66},
    {160, 96, 211}, {300, 5, 305}, {129, 130, 197}};

// Checks c (ldc-strided) against alpha op(a) op(b) + beta c0, and that the
// padding columns beyond n are untouched.
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
      ASSERT_NEAR(c[i * ldc + j], ref, GemmBound(g.k, mag)) << i << "," << j;
    }
  }
}

TEST_P(BackendConformanceTest, GemmMatchesReferenceAllTransposes) {
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

TEST_P(BackendConformanceTest, GemmWithZeroKScalesC) {
  const std::vector<float> c0 = RandomNormal(3 * 4, 7);
  DeviceBuffer dc = Upload(c0);
  ASSERT_OK(backend_->Gemm(Transpose::kNo, Transpose::kNo, 3, 4, 0, 1.0f,
                           nullptr, 1, nullptr, 4, 2.0f, dc.data(), 4));
  const std::vector<float> c = Download(dc);
  for (size_t i = 0; i < c.size(); ++i) EXPECT_EQ(c[i], 2.0f * c0[i]);
}

TEST_P(BackendConformanceTest, GemmStridedBatchedMatchesPerMatrixReference) {
  const int64_t batch = 3;
  uint32_t seed = 200;
  for (const GemmCase& g :
       {GemmCase{13, 5, 7}, GemmCase{1, 7, 7}, GemmCase{37, 53, 66},
        GemmCase{300, 5, 305}, GemmCase{129, 130, 197}}) {
    for (Transpose ta : {Transpose::kNo, Transpose::kYes}) {
      for (Transpose tb : {Transpose::kNo, Transpose::kYes}) {
        SCOPED_TRACE(absl::StrCat("m=", g.m, " ta=", ta == Transpose::kYes,
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
            ta, tb, g.m, g.n, g.k, 1.5f, da.data(), lda, stride_a, db.data(),
            ldb, stride_b, 0.25f, dc.data(), ldc, stride_c, batch));
        const std::vector<float> c = Download(dc);
        for (int64_t i = 0; i < batch; ++i) {
          SCOPED_TRACE(absl::StrCat("batch entry ", i));
          auto slice = [](const std::vector<float>& v, int64_t start,
                          int64_t len) {
            return std::vector<float>(v.begin() + start,
                                      v.begin() + start + len);
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
}

TEST_P(BackendConformanceTest, SyrkWritesBothTrianglesBothTransposes) {
  const std::pair<int64_t, int64_t> cases[] = {
      {1, 7},   {7, 1},   {13, 5},   {5, 13},  {31, 31},  {48, 64},
      {64, 64}, {37, 53}, {160, 96}, {300, 5}, {129, 130}};
  uint32_t seed = 300;
  for (const auto& [n, k] : cases) {
    for (Transpose t : {Transpose::kNo, Transpose::kYes}) {
      // beta != 0 reads one triangle of C, so it must be symmetric; beta == 0
      // must not read C at all: start from a non-symmetric one.
      for (float beta : {0.5f, 0.0f}) {
        SCOPED_TRACE(absl::StrCat("n=", n, " k=", k, " trans=",
                                  t == Transpose::kYes, " beta=", beta));
        const Shape sa = Stored(t, n, k);  // op(A) = A or A^T is n x k
        const int64_t lda = sa.cols + 2, ldc = n + 3;
        const std::vector<float> a = RandomNormal(sa.rows * lda, ++seed);
        std::vector<float> c0 = RandomNormal(n * ldc, ++seed);
        if (beta != 0.0f) {
          for (int64_t i = 0; i < n; ++i) {
            for (int64_t j = 0; j < i; ++j) c0[i * ldc + j] = c0[j * ldc + i];
          }
        }
        DeviceBuffer da = Upload(a), dc = Upload(c0);
        const float alpha = 1.25f;
        ASSERT_OK(backend_->Syrk(t, n, k, alpha, da.data(), lda, beta,
                                 dc.data(), ldc));
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
            ASSERT_NEAR(c[i * ldc + j], ref, GemmBound(k, mag))
                << i << "," << j;
            ASSERT_EQ(c[i * ldc + j], c[j * ldc + i]) << "not symmetric";
          }
        }
      }
    }
  }
}

// ---- Eigen / QR
// -----------------------------------------------------------------

TEST_P(BackendConformanceTest, SymmetricEigenBothPrecisions) {
  for (EigenPrecision precision :
       {EigenPrecision::kFloat32, EigenPrecision::kFloat64}) {
    // kFloat64 solves in double: what remains is rounding the results to
    // float32, the same for every backend.
    const double tol = precision == EigenPrecision::kFloat32
                           ? tolerances().eigen_float32
                           : 2e-6;
    for (int64_t n : {1, 2, 7, 13, 17, 31, 64, 200}) {
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

// A NaN or an infinity in the matrix, or a finite matrix whose largest
// eigenvalue (6e38) is past float32's range (solved in double, rounded to
// inf), is INTERNAL in both precisions, from the solver's own report: a
// rule then fails its step instead of rooting NaN or inf eigenvalues. The
// backend stays usable: a good matrix solves right after.
TEST_P(BackendConformanceTest, SymmetricEigenFailsOnANonFiniteEigenvalue) {
  const int64_t n = 5;
  const float big = 3e38f;
  struct Bad {
    const char* name;
    std::vector<float> a;
  };
  std::vector<float> nan = RandomSymmetric(n, 470);
  nan[2 * n + 3] = nan[3 * n + 2] = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> inf = RandomSymmetric(n, 471);
  inf[1 * n + 1] = std::numeric_limits<float>::infinity();
  std::vector<float> overflow(n * n, 0.0f);
  overflow[0] = overflow[1] = overflow[n] = overflow[n + 1] = big;
  for (EigenPrecision precision :
       {EigenPrecision::kFloat32, EigenPrecision::kFloat64}) {
    for (const Bad& bad :
         {Bad{"nan", nan}, Bad{"inf", inf}, Bad{"overflow", overflow}}) {
      SCOPED_TRACE(absl::StrCat(
          bad.name, " f64=", precision == EigenPrecision::kFloat64));
      DeviceBuffer da = Upload(bad.a), dw = Zeros(n);
      const absl::Status status =
          backend_->SymmetricEigen(n, da.data(), dw.data(), precision);
      EXPECT_EQ(status.code(), absl::StatusCode::kInternal) << status;
    }
    const std::vector<float> good = RandomSymmetric(n, 472);
    DeviceBuffer da = Upload(good), dw = Zeros(n);
    ASSERT_OK(backend_->SymmetricEigen(n, da.data(), dw.data(), precision));
    const auto [residual, orth] =
        EigenErrors(good, Download(da), Download(dw), n);
    EXPECT_LT(residual, 1e-4);
  }
}

TEST_P(BackendConformanceTest, SymmetricEigenRecoversKnownSpectrum) {
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

TEST_P(BackendConformanceTest, QrOrthonormalizeMatchesLapackConvention) {
  const Shape shapes[] = {{13, 5},  {64, 48},  {31, 31}, {7, 1},
                          {1, 1},   {5, 5},    {100, 3}, {64, 64},
                          {53, 37}, {160, 96}, {300, 5}, {130, 129}};
  const double tol = tolerances().qr;
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
        ASSERT_NEAR(qtq[i * n + j], i == j ? 1.0 : 0.0, tol)
            << "Q^T Q at " << i << "," << j;
        if (i > j) {
          ASSERT_NEAR(r[i * n + j], 0.0, tol * scale)
              << "Q^T A below diagonal at " << i << "," << j;
        }
      }
      // Same signs and magnitudes as LAPACK's Householder R.
      ASSERT_NEAR(r[i * n + i], r_diag[i], tol * scale) << "R diag " << i;
    }
  }
}

// ---- Newton-Schulz
// ----------------------------------------------------------------

// Runs spec on `batch` random matrices (of different magnitudes: the
// normalization must be per matrix, not over the batch) and compares each
// with the float64 reference; out of place also checks the input survives.
void ExpectNewtonSchulzMatches(Backend& backend, const NewtonSchulzSpec& spec,
                               int64_t batch, int64_t rows, int64_t cols,
                               uint32_t seed, bool in_place, double tol) {
  SCOPED_TRACE(absl::StrCat("batch=", batch, " ", ShapeName(rows, cols),
                            in_place ? " in place" : ""));
  const int64_t per = rows * cols;
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
    EXPECT_LE(RelativeError(got, ref), tol) << "matrix " << i;
  }
}

TEST_P(BackendConformanceTest, NewtonSchulzMatchesFloat64Reference) {
  const Shape shapes[] = {{1, 7},   {7, 1},   {13, 5},  {5, 13},
                          {31, 31}, {64, 48}, {48, 64}, {3, 100},
                          {64, 64}, {37, 53}, {1, 17}};
  uint32_t seed = 600;
  for (const Shape& s : shapes) {
    ExpectNewtonSchulzMatches(*backend_, QuinticSpec(), 1, s.rows, s.cols,
                              seed += 10, false, tolerances().newton_schulz);
  }
}

TEST_P(BackendConformanceTest, NewtonSchulzBatchedTallAndWide) {
  const double tol = tolerances().newton_schulz;
  const NewtonSchulzSpec spec = QuinticSpec();
  ExpectNewtonSchulzMatches(*backend_, spec, 3, 13, 5, 700, false, tol);
  ExpectNewtonSchulzMatches(*backend_, spec, 3, 5, 13, 710, false, tol);
  ExpectNewtonSchulzMatches(*backend_, spec, 4, 64, 48, 720, false, tol);
  ExpectNewtonSchulzMatches(*backend_, spec, 3, 96, 160, 730, false, tol);
  ExpectNewtonSchulzMatches(*backend_, spec, 2, 160, 96, 740, false, tol);
  ExpectNewtonSchulzMatches(*backend_, spec, 4, 53, 37, 750, false, tol);
}

TEST_P(BackendConformanceTest, NewtonSchulzPerStepCoefficientsAndNormScale) {
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
  const double tol = tolerances().newton_schulz;
  ExpectNewtonSchulzMatches(*backend_, spec, 2, 31, 17, 800, false, tol);
  ExpectNewtonSchulzMatches(*backend_, spec, 2, 17, 31, 810, false, tol);
}

TEST_P(BackendConformanceTest, NewtonSchulzEachCoefficientAlone) {
  // Steps where only a, only b or only c is non-zero, then all three: the
  // backends fold a I into the polynomial (server/DESIGN.md 3.1), so a
  // misplaced identity (another matrix of the batch, the wrong orientation)
  // or a dropped term shows here on its own.
  NewtonSchulzSpec spec;
  spec.coefficients = {{1.5f, 0.0f, 0.0f},
                       {0.0f, 1.25f, 0.0f},
                       {0.0f, 0.0f, 2.0f},
                       {2.0f, -1.5f, 0.5f}};
  const double tol = tolerances().newton_schulz;
  ExpectNewtonSchulzMatches(*backend_, spec, 3, 19, 11, 830, false, tol);
  ExpectNewtonSchulzMatches(*backend_, spec, 2, 11, 19, 840, true, tol);
}

TEST_P(BackendConformanceTest, NewtonSchulzFullProductsMatchTheReferenceToo) {
  // symmetric_products (the default, above) computes one triangle of X X^T
  // and of A A and mirrors it; the full GEMMs it is measured against
  // (canzonactl bench kernels) must be the same iteration. Both orientations
  // and a batch, since the triangle is per matrix and per orientation.
  NewtonSchulzSpec spec = QuinticSpec();
  spec.symmetric_products = false;
  const double tol = tolerances().newton_schulz;
  ExpectNewtonSchulzMatches(*backend_, spec, 3, 19, 11, 880, false, tol);
  ExpectNewtonSchulzMatches(*backend_, spec, 2, 48, 64, 890, false, tol);
}

TEST_P(BackendConformanceTest, NewtonSchulzNormalizationOnly) {
  // No coefficient steps: X / (norm_scale ||X||_F + eps) alone.
  NewtonSchulzSpec spec;
  spec.norm_scale = 2.0f;
  const double tol = tolerances().newton_schulz;
  ExpectNewtonSchulzMatches(*backend_, spec, 3, 37, 53, 850, false, tol);
  ExpectNewtonSchulzMatches(*backend_, spec, 1, 53, 37, 860, true, tol);
  ExpectNewtonSchulzMatches(*backend_, spec, 1, 1, 17, 870, false, tol);
}

TEST_P(BackendConformanceTest, NewtonSchulzInputMayEqualOutput) {
  const double tol = tolerances().newton_schulz;
  const NewtonSchulzSpec spec = QuinticSpec();
  ExpectNewtonSchulzMatches(*backend_, spec, 2, 13, 5, 900, true, tol);
  ExpectNewtonSchulzMatches(*backend_, spec, 2, 5, 13, 910, true, tol);
  ExpectNewtonSchulzMatches(*backend_, spec, 1, 31, 31, 920, true, tol);
}

TEST_P(BackendConformanceTest, NewtonSchulzConvergesToPolarFactor) {
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

}  // namespace
}  // namespace canzona
