// The cuda backend checked against the cpu backend: every kernel runs on both
// backends with the same random inputs (fixed seeds, normal values) and the
// results must agree within 1e-4 relative Frobenius error (float32), or 2e-2
// for the bf16 Newton-Schulz against the cpu's float32 one. Eigenvectors are
// compared through reconstructions (their signs are arbitrary); QR's Q is
// compared directly (both follow LAPACK's geqrf + orgqr sign convention).
//
// Every test skips when no CUDA device is usable.
#include "kernels/cuda/cuda_backend.h"

#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/base/status_macros.h"
#include "tests/matchers/status_matchers.h"

namespace canzona {
namespace {

using ::canzona::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::StartsWith;

using HostBuffers = std::vector<std::vector<float>>;
// An operation on device copies of the inputs (same order).
using Op = std::function<absl::Status(Backend&, const std::vector<float*>&)>;

constexpr double kFp32Tol = 1e-4;
constexpr double kBf16NsTol = 2e-2;

std::vector<float> RandomNormal(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(rng);
  return v;
}

std::vector<float> RandomPositive(int64_t n, uint32_t seed) {
  std::vector<float> v = RandomNormal(n, seed);
  for (float& x : v) x = std::fabs(x) + 0.01f;
  return v;
}

// Random symmetric n x n matrix (B + B^T) / 2.
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

std::vector<int64_t> RandomPermutation(int64_t n, uint32_t seed) {
  std::vector<int64_t> perm(static_cast<size_t>(n));
  std::iota(perm.begin(), perm.end(), 0);
  std::mt19937 rng(seed);
  std::shuffle(perm.begin(), perm.end(), rng);
  return perm;
}

double FrobeniusNorm(const std::vector<float>& a) {
  double sum = 0.0;
  for (float x : a) sum += static_cast<double>(x) * x;
  return std::sqrt(sum);
}

// ||actual - expected||_F / ||expected||_F (absolute when expected is 0).
double RelativeError(const std::vector<float>& expected,
                     const std::vector<float>& actual) {
  double diff = 0.0;
  for (size_t i = 0; i < expected.size(); ++i) {
    const double d = static_cast<double>(actual[i]) - expected[i];
    diff += d * d;
  }
  const double norm = FrobeniusNorm(expected);
  return norm > 0.0 ? std::sqrt(diff) / norm : std::sqrt(diff);
}

absl::StatusOr<DeviceBuffer> Upload(Backend& backend,
                                    const std::vector<float>& host) {
  CANZONA_ASSIGN_OR_RETURN(DeviceBuffer buffer,
                           backend.Allocate(static_cast<int64_t>(host.size())));
  CANZONA_RETURN_IF_ERROR(backend.CopyFromHost(
      host.data(), static_cast<int64_t>(host.size()), buffer.data()));
  return buffer;
}

absl::StatusOr<std::vector<float>> Download(Backend& backend,
                                            const DeviceBuffer& buffer) {
  std::vector<float> host(static_cast<size_t>(buffer.size()));
  CANZONA_RETURN_IF_ERROR(
      backend.CopyToHost(buffer.data(), buffer.size(), host.data()));
  return host;
}

// Uploads `inputs`, runs `op` on the device copies and returns every
// buffer's final contents.
absl::StatusOr<HostBuffers> RunOp(Backend& backend, const HostBuffers& inputs,
                                  const Op& op) {
  std::vector<DeviceBuffer> buffers;
  std::vector<float*> pointers;
  for (const std::vector<float>& input : inputs) {
    CANZONA_ASSIGN_OR_RETURN(DeviceBuffer buffer, Upload(backend, input));
    pointers.push_back(buffer.data());
    buffers.push_back(std::move(buffer));
  }
  CANZONA_RETURN_IF_ERROR(op(backend, pointers));
  HostBuffers outputs;
  for (const DeviceBuffer& buffer : buffers) {
    CANZONA_ASSIGN_OR_RETURN(std::vector<float> host,
                             Download(backend, buffer));
    outputs.push_back(std::move(host));
  }
  return outputs;
}

class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    ASSERT_OK_AND_ASSIGN(cuda_, CreateBackend(BackendKind::kCuda, 0));
    ASSERT_OK_AND_ASSIGN(cpu_, CreateBackend(BackendKind::kCpu));
  }

  // Runs `op` on both backends; every buffer must agree within `tol`.
  void Compare(const HostBuffers& inputs, const Op& op, double tol = kFp32Tol) {
    ASSERT_OK_AND_ASSIGN(HostBuffers want, RunOp(*cpu_, inputs, op));
    ASSERT_OK_AND_ASSIGN(HostBuffers got, RunOp(*cuda_, inputs, op));
    ASSERT_EQ(want.size(), got.size());
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_LE(RelativeError(want[i], got[i]), tol) << "buffer " << i;
    }
  }

  std::unique_ptr<Backend> cuda_;
  std::unique_ptr<Backend> cpu_;
};

// ---- Backend basics ---------------------------------------------------------

TEST_F(CudaBackendTest, DescribesDevice) {
  EXPECT_EQ(cuda_->kind(), BackendKind::kCuda);
  EXPECT_THAT(cuda_->description(), StartsWith("cuda:0 ("));
  EXPECT_THAT(cuda_->description(), HasSubstr(", sm_"));
}

TEST_F(CudaBackendTest, RejectsBadDeviceIndex) {
  EXPECT_THAT(CreateCudaBackend(-1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("-1")));
  EXPECT_THAT(CreateCudaBackend(CudaDeviceCount()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("range")));
}

TEST_F(CudaBackendTest, AllocateIsZeroFilled) {
  ASSERT_OK_AND_ASSIGN(DeviceBuffer buffer, cuda_->Allocate(1001));
  ASSERT_OK_AND_ASSIGN(std::vector<float> host, Download(*cuda_, buffer));
  EXPECT_EQ(host, std::vector<float>(1001, 0.0f));
  ASSERT_OK_AND_ASSIGN(DeviceBuffer empty, cuda_->Allocate(0));
  EXPECT_TRUE(empty.empty());
}

TEST_F(CudaBackendTest, RoundTripsAndCopies) {
  const std::vector<float> x = RandomNormal(4099, 1);
  ASSERT_OK_AND_ASSIGN(DeviceBuffer a, Upload(*cuda_, x));
  ASSERT_OK_AND_ASSIGN(DeviceBuffer b, cuda_->Allocate(4099));
  ASSERT_OK(cuda_->Copy(a.data(), 4099, b.data()));
  ASSERT_OK_AND_ASSIGN(std::vector<float> back, Download(*cuda_, b));
  EXPECT_EQ(back, x);
}

TEST_F(CudaBackendTest, Copy2DAndFill) {
  const int64_t rows = 37, cols = 53, src_ld = 55, dst_ld = 60;
  Compare({RandomNormal(rows * src_ld, 2), RandomNormal(rows * dst_ld, 3)},
          [&](Backend& b, const std::vector<float*>& p) {
            return b.Copy2D(rows, cols, p[0], src_ld, p[1], dst_ld);
          });
  Compare({RandomNormal(1001, 4)},
          [](Backend& b, const std::vector<float*>& p) {
            return b.Fill(2.5f, 1000, p[0] + 1);  // unaligned: scalar path
          });
}

TEST_F(CudaBackendTest, ZeroSizeCallsAreNoOps) {
  EXPECT_OK(cuda_->Lerp(0, nullptr, nullptr, 0.5f, nullptr));
  EXPECT_OK(cuda_->Gemm(Transpose::kNo, Transpose::kNo, 0, 0, 0, 1.0f, nullptr,
                        1, nullptr, 1, 0.0f, nullptr, 1));
  EXPECT_OK(
      cuda_->SymmetricEigen(0, nullptr, nullptr, EigenPrecision::kFloat32));
  EXPECT_OK(
      cuda_->NewtonSchulz(NewtonSchulzSpec{}, 0, 16, 16, nullptr, nullptr));
  ASSERT_OK_AND_ASSIGN(double sum, cuda_->SumSquares(0, nullptr));
  EXPECT_EQ(sum, 0.0);
  ASSERT_OK_AND_ASSIGN(bool finite, cuda_->AllFinite(0, nullptr));
  EXPECT_TRUE(finite);
}

TEST_F(CudaBackendTest, RejectsBadArguments) {
  ASSERT_OK_AND_ASSIGN(DeviceBuffer buf, cuda_->Allocate(64));
  float* p = buf.data();
  EXPECT_THAT(cuda_->Gemm(Transpose::kNo, Transpose::kNo, -1, 2, 2, 1.0f, p, 2,
                          p, 2, 0.0f, p, 2),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("m")));
  EXPECT_THAT(cuda_->Gemm(Transpose::kNo, Transpose::kNo, 2, 4, 4, 1.0f, p, 3,
                          p, 4, 0.0f, p, 4),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("lda")));
  EXPECT_THAT(cuda_->Lerp(4, nullptr, p, 0.5f, p),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("null")));
  const std::vector<int64_t> not_perm = {0, 0, 1, 2};
  EXPECT_THAT(
      cuda_->GatherColumns(2, 4, not_perm, p, p + 32),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("permutation")));
  EXPECT_THAT(cuda_->QrOrthonormalize(2, 4, p),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rows")));
  EXPECT_THAT(
      cuda_->AdamWStep(4, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f, 0, p, p, p, p),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("step")));
}

// ---- Elementwise ------------------------------------------------------------

// Odd sizes exercise the float4 body plus scalar tail; offset 1 forces the
// unaligned scalar path.
class CudaElementwiseTest : public CudaBackendTest,
                            public ::testing::WithParamInterface<int64_t> {};

TEST_P(CudaElementwiseTest, MatchesCpu) {
  for (int64_t offset : {0, 1}) {
    const int64_t n = GetParam();
    const int64_t size = n + offset;
    SCOPED_TRACE(absl::StrCat("n=", n, " offset=", offset));
    for (float w : {0.1f, 0.9f}) {
      Compare({RandomNormal(size, 10), RandomNormal(size, 11),
               RandomNormal(size, 12)},
              [&](Backend& b, const std::vector<float*>& p) {
                return b.Lerp(n, p[0] + offset, p[1] + offset, w,
                              p[2] + offset);
              });
    }
    Compare({RandomNormal(size, 13), RandomNormal(size, 14)},
            [&](Backend& b, const std::vector<float*>& p) {
              CANZONA_RETURN_IF_ERROR(
                  b.Axpby(n, 0.7f, p[0] + offset, -1.3f, p[1] + offset));
              return b.Scale(n, 0.25f, p[0] + offset);
            });
    Compare({RandomNormal(size, 15), RandomPositive(size, 16)},
            [&](Backend& b, const std::vector<float*>& p) {
              return b.EmaSquare(n, 0.95f, 0.05f, p[0] + offset, p[1] + offset);
            });
    Compare({RandomNormal(size, 17), RandomPositive(size, 18),
             RandomNormal(size, 19)},
            [&](Backend& b, const std::vector<float*>& p) {
              return b.AdamDirection(n, p[0] + offset, 1.1f, p[1] + offset,
                                     1.7f, 1e-8f, p[2] + offset);
            });
    for (int64_t step : {1, 10}) {
      Compare({RandomNormal(size, 20), RandomNormal(size, 21),
               RandomNormal(size, 22), RandomPositive(size, 23)},
              [&](Backend& b, const std::vector<float*>& p) {
                return b.AdamWStep(n, 1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, step,
                                   p[0] + offset, p[1] + offset, p[2] + offset,
                                   p[3] + offset);
              });
    }
  }
}

TEST_P(CudaElementwiseTest, ReductionsMatchCpu) {
  const int64_t n = GetParam();
  const std::vector<float> x = RandomNormal(n, 30);
  ASSERT_OK_AND_ASSIGN(DeviceBuffer gx, Upload(*cuda_, x));
  ASSERT_OK_AND_ASSIGN(DeviceBuffer cx, Upload(*cpu_, x));
  ASSERT_OK_AND_ASSIGN(double got, cuda_->SumSquares(n, gx.data()));
  ASSERT_OK_AND_ASSIGN(double want, cpu_->SumSquares(n, cx.data()));
  EXPECT_NEAR(got, want, 1e-6 * want);
  ASSERT_OK_AND_ASSIGN(bool finite, cuda_->AllFinite(n, gx.data()));
  EXPECT_TRUE(finite);
  for (float bad : {std::nanf(""), INFINITY, -INFINITY}) {
    std::vector<float> y = x;
    y[n / 2] = bad;
    ASSERT_OK_AND_ASSIGN(DeviceBuffer gy, Upload(*cuda_, y));
    ASSERT_OK_AND_ASSIGN(finite, cuda_->AllFinite(n, gy.data()));
    EXPECT_FALSE(finite) << bad;
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, CudaElementwiseTest,
                         ::testing::Values(1, 7, 1001, 65537, 1 << 20));

// ---- Matrix helpers ---------------------------------------------------------

struct Shape {
  int64_t rows;
  int64_t cols;
};

// Readable test names (gtest and ctest) instead of byte dumps.
void PrintTo(const Shape& s, std::ostream* os) {
  *os << s.rows << "x" << s.cols;
}
std::string ShapeName(const ::testing::TestParamInfo<Shape>& info) {
  return absl::StrCat(info.param.rows, "x", info.param.cols);
}

class CudaMatrixTest : public CudaBackendTest,
                       public ::testing::WithParamInterface<Shape> {};

TEST_P(CudaMatrixTest, HelpersMatchCpu) {
  const auto [rows, cols] = GetParam();
  const int64_t size = rows * cols;
  Compare({RandomNormal(rows * rows, 40)},
          [&](Backend& b, const std::vector<float*>& p) {
            return b.AddIdentity(rows, 0.5f, p[0]);
          });
  Compare({RandomNormal(cols, 41), RandomNormal(size, 42)},
          [&](Backend& b, const std::vector<float*>& p) {
            return b.ScaleColumns(rows, cols, p[0], p[1]);
          });
  Compare(
      {RandomNormal(size, 43), RandomNormal(size, 44), RandomNormal(cols, 45)},
      [&](Backend& b, const std::vector<float*>& p) {
        return b.ColumnDots(rows, cols, p[0], p[1], p[2]);
      });
  const std::vector<int64_t> col_perm = RandomPermutation(cols, 46);
  const std::vector<int64_t> row_perm = RandomPermutation(rows, 47);
  Compare(
      {RandomNormal(size, 48), RandomNormal(size, 49), RandomNormal(size, 50)},
      [&](Backend& b, const std::vector<float*>& p) {
        CANZONA_RETURN_IF_ERROR(
            b.GatherColumns(rows, cols, col_perm, p[0], p[1]));
        return b.GatherRows(rows, cols, row_perm, p[0], p[2]);
      });
  Compare({RandomNormal(size, 51), RandomNormal(size, 52)},
          [&](Backend& b, const std::vector<float*>& p) {
            return b.Transpose2D(rows, cols, p[0], p[1]);
          });
}

TEST_P(CudaMatrixTest, GemmMatchesCpu) {
  const auto [m, n] = GetParam();
  const int64_t k = m + n / 2 + 3;
  for (Transpose ta : {Transpose::kNo, Transpose::kYes}) {
    for (Transpose tb : {Transpose::kNo, Transpose::kYes}) {
      SCOPED_TRACE(absl::StrCat("ta=", ta == Transpose::kYes,
                                " tb=", tb == Transpose::kYes));
      // Padded leading dimensions.
      const int64_t a_rows = ta == Transpose::kNo ? m : k;
      const int64_t lda = (ta == Transpose::kNo ? k : m) + 3;
      const int64_t b_rows = tb == Transpose::kNo ? k : n;
      const int64_t ldb = (tb == Transpose::kNo ? n : k) + 1;
      const int64_t ldc = n + 2;
      Compare({RandomNormal(a_rows * lda, 60), RandomNormal(b_rows * ldb, 61),
               RandomNormal(m * ldc, 62)},
              [&](Backend& b, const std::vector<float*>& p) {
                return b.Gemm(ta, tb, m, n, k, 0.8f, p[0], lda, p[1], ldb,
                              -0.5f, p[2], ldc);
              });
      const int64_t batch = 3;
      const int64_t sa = a_rows * lda + 5, sb = b_rows * ldb + 7,
                    sc = m * ldc + 1;
      Compare({RandomNormal(batch * sa, 63), RandomNormal(batch * sb, 64),
               RandomNormal(batch * sc, 65)},
              [&](Backend& b, const std::vector<float*>& p) {
                return b.GemmStridedBatched(ta, tb, m, n, k, 1.25f, p[0], lda,
                                            sa, p[1], ldb, sb, 0.5f, p[2], ldc,
                                            sc, batch);
              });
    }
  }
}

TEST_P(CudaMatrixTest, SyrkMatchesCpuAndIsSymmetric) {
  const auto [n, k] = GetParam();
  for (Transpose t : {Transpose::kNo, Transpose::kYes}) {
    SCOPED_TRACE(absl::StrCat("trans=", t == Transpose::kYes));
    const int64_t a_rows = t == Transpose::kNo ? n : k;
    const int64_t lda = (t == Transpose::kNo ? k : n) + 2;
    // beta != 0 reads one triangle of C: start from a symmetric C.
    Compare({RandomNormal(a_rows * lda, 70), RandomSymmetric(n, 71)},
            [&](Backend& b, const std::vector<float*>& p) {
              return b.Syrk(t, n, k, 0.9f, p[0], lda, 0.3f, p[1], n);
            });
    ASSERT_OK_AND_ASSIGN(
        HostBuffers got,
        RunOp(*cuda_, {RandomNormal(a_rows * lda, 72), RandomNormal(n * n, 73)},
              [&](Backend& b, const std::vector<float*>& p) {
                return b.Syrk(t, n, k, 1.0f, p[0], lda, 0.0f, p[1], n);
              }));
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < i; ++j) {
        ASSERT_EQ(got[1][i * n + j], got[1][j * n + i]) << i << "," << j;
      }
    }
  }
}

TEST_P(CudaMatrixTest, QrMatchesCpu) {
  auto [rows, cols] = GetParam();
  if (rows < cols) std::swap(rows, cols);
  Compare({RandomNormal(rows * cols, 80)},
          [&](Backend& b, const std::vector<float*>& p) {
            return b.QrOrthonormalize(rows, cols, p[0]);
          });
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaMatrixTest,
                         ::testing::Values(Shape{64, 64}, Shape{37, 53},
                                           Shape{160, 96}, Shape{1, 7},
                                           Shape{300, 5}, Shape{129, 130}),
                         ShapeName);

// ---- Symmetric eigendecomposition -------------------------------------------

class CudaEigenTest : public CudaBackendTest,
                      public ::testing::WithParamInterface<int64_t> {};

TEST_P(CudaEigenTest, ReconstructsInput) {
  const int64_t n = GetParam();
  const std::vector<float> a = RandomSymmetric(n, 90);
  for (EigenPrecision precision :
       {EigenPrecision::kFloat32, EigenPrecision::kFloat64}) {
    SCOPED_TRACE(precision == EigenPrecision::kFloat32 ? "fp32" : "fp64");
    auto eig = [&](Backend& b, const std::vector<float*>& p) {
      return b.SymmetricEigen(n, p[0], p[1], precision);
    };
    ASSERT_OK_AND_ASSIGN(HostBuffers got,
                         RunOp(*cuda_, {a, std::vector<float>(n)}, eig));
    ASSERT_OK_AND_ASSIGN(HostBuffers want,
                         RunOp(*cpu_, {a, std::vector<float>(n)}, eig));
    const std::vector<float>& v = got[0];
    const std::vector<float>& w = got[1];
    EXPECT_LE(RelativeError(want[1], w), kFp32Tol);
    EXPECT_TRUE(std::is_sorted(w.begin(), w.end()));
    // V diag(w) V^T == A and V^T V == I, with eigenvectors as columns.
    std::vector<float> recon(n * n), gram(n * n);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        double r = 0.0, g = 0.0;
        for (int64_t l = 0; l < n; ++l) {
          r += static_cast<double>(v[i * n + l]) * w[l] * v[j * n + l];
          g += static_cast<double>(v[l * n + i]) * v[l * n + j];
        }
        recon[i * n + j] = static_cast<float>(r);
        gram[i * n + j] = static_cast<float>(g) - (i == j ? 1.0f : 0.0f);
      }
    }
    EXPECT_LE(RelativeError(a, recon), kFp32Tol);
    EXPECT_LE(FrobeniusNorm(gram) / std::sqrt(static_cast<double>(n)),
              kFp32Tol);
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, CudaEigenTest,
                         ::testing::Values(1, 17, 64, 200));

// ---- Newton-Schulz ----------------------------------------------------------

struct NsShape {
  int64_t batch;
  int64_t rows;
  int64_t cols;
};

void PrintTo(const NsShape& s, std::ostream* os) {
  *os << s.batch << "x" << s.rows << "x" << s.cols;
}
std::string NsShapeName(const ::testing::TestParamInfo<NsShape>& info) {
  return absl::StrCat(info.param.batch, "x", info.param.rows, "x",
                      info.param.cols);
}

NewtonSchulzSpec DefaultSpec(NsPrecision precision) {
  NewtonSchulzSpec spec;
  spec.coefficients.assign(5, {3.4445f, -4.7750f, 2.0315f});
  spec.precision = precision;
  return spec;
}

class CudaNewtonSchulzTest : public CudaBackendTest,
                             public ::testing::WithParamInterface<NsShape> {
 protected:
  // cuda in `precision`, cpu always in float32 (its only precision).
  void CompareNs(NewtonSchulzSpec spec, double tol) {
    const auto [batch, rows, cols] = GetParam();
    const int64_t count = batch * rows * cols;
    Compare(
        {RandomNormal(count, 100), std::vector<float>(count)},
        [&](Backend& b, const std::vector<float*>& p) {
          NewtonSchulzSpec s = spec;
          if (b.kind() == BackendKind::kCpu) {
            s.precision = NsPrecision::kFloat32;
          }
          return b.NewtonSchulz(s, batch, rows, cols, p[0], p[1]);
        },
        tol);
  }
};

TEST_P(CudaNewtonSchulzTest, Float32MatchesCpu) {
  CompareNs(DefaultSpec(NsPrecision::kFloat32), kFp32Tol);
}

TEST_P(CudaNewtonSchulzTest, Bfloat16MatchesCpuFloat32) {
  CompareNs(DefaultSpec(NsPrecision::kBfloat16), kBf16NsTol);
}

TEST_P(CudaNewtonSchulzTest, NormalizationOnly) {
  NewtonSchulzSpec spec = DefaultSpec(NsPrecision::kFloat32);
  spec.coefficients.clear();
  spec.norm_scale = 2.0f;
  CompareNs(spec, kFp32Tol);
}

TEST_P(CudaNewtonSchulzTest, InPlaceEqualsOutOfPlace) {
  const auto [batch, rows, cols] = GetParam();
  const int64_t count = batch * rows * cols;
  const std::vector<float> x = RandomNormal(count, 101);
  for (NsPrecision precision :
       {NsPrecision::kFloat32, NsPrecision::kBfloat16}) {
    const NewtonSchulzSpec spec = DefaultSpec(precision);
    ASSERT_OK_AND_ASSIGN(HostBuffers out_of_place,
                         RunOp(*cuda_, {x, std::vector<float>(count)},
                               [&](Backend& b, const std::vector<float*>& p) {
                                 return b.NewtonSchulz(spec, batch, rows, cols,
                                                       p[0], p[1]);
                               }));
    ASSERT_OK_AND_ASSIGN(
        HostBuffers in_place,
        RunOp(*cuda_, {x}, [&](Backend& b, const std::vector<float*>& p) {
          return b.NewtonSchulz(spec, batch, rows, cols, p[0], p[0]);
        }));
    // Same computation; only the input buffer's alignment may change the
    // norm's summation order (float4 or scalar loads).
    EXPECT_LE(RelativeError(out_of_place[1], in_place[0]), 1e-6);
  }
}

// CUDA graphs: later calls on the same buffers replay the graph captured by
// the first; each must compute on the buffers' current contents, equal to
// a backend without graphs (CANZONA_CUDA_GRAPHS=0) and to the cpu backend.
TEST_F(CudaBackendTest, NewtonSchulzGraphReplaysSeeFreshData) {
  ::setenv("CANZONA_CUDA_GRAPHS", "0", 1);
  absl::StatusOr<std::unique_ptr<Backend>> eager =
      CreateBackend(BackendKind::kCuda, 0);
  ::unsetenv("CANZONA_CUDA_GRAPHS");
  ASSERT_OK(eager);
  const int64_t rows = 96, cols = 160, n = rows * cols;
  for (NsPrecision precision :
       {NsPrecision::kFloat32, NsPrecision::kBfloat16}) {
    const NewtonSchulzSpec spec = DefaultSpec(precision);
    ASSERT_OK_AND_ASSIGN(DeviceBuffer x, cuda_->Allocate(n));
    ASSERT_OK_AND_ASSIGN(DeviceBuffer y, (*eager)->Allocate(n));
    ASSERT_OK_AND_ASSIGN(DeviceBuffer c, cpu_->Allocate(n));
    for (int round = 0; round < 3; ++round) {
      SCOPED_TRACE(::testing::Message() << "round " << round);
      const std::vector<float> data = RandomNormal(n, 200 + round);
      ASSERT_OK(cuda_->CopyFromHost(data.data(), n, x.data()));
      ASSERT_OK(cuda_->NewtonSchulz(spec, 1, rows, cols, x.data(), x.data()));
      ASSERT_OK((*eager)->CopyFromHost(data.data(), n, y.data()));
      ASSERT_OK(
          (*eager)->NewtonSchulz(spec, 1, rows, cols, y.data(), y.data()));
      NewtonSchulzSpec fp32 = spec;
      fp32.precision = NsPrecision::kFloat32;
      ASSERT_OK(cpu_->CopyFromHost(data.data(), n, c.data()));
      ASSERT_OK(cpu_->NewtonSchulz(fp32, 1, rows, cols, c.data(), c.data()));
      ASSERT_OK_AND_ASSIGN(std::vector<float> got, Download(*cuda_, x));
      ASSERT_OK_AND_ASSIGN(std::vector<float> want, Download(**eager, y));
      ASSERT_OK_AND_ASSIGN(std::vector<float> ref, Download(*cpu_, c));
      EXPECT_LE(RelativeError(want, got), 1e-6);
      EXPECT_LE(RelativeError(ref, got),
                precision == NsPrecision::kFloat32 ? kFp32Tol : kBf16NsTol);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaNewtonSchulzTest,
    ::testing::Values(NsShape{1, 64, 64}, NsShape{3, 96, 160},
                      NsShape{2, 160, 96}, NsShape{1, 37, 53},
                      NsShape{4, 53, 37}, NsShape{1, 1, 17},
                      NsShape{1, 256, 1024}),
    NsShapeName);

}  // namespace
}  // namespace canzona
