// The conformance fixture, memory operations, argument validation and
// zero-size calls (kernels: backend_conformance_elementwise.cc and
// backend_conformance_linalg.cc).
#include "tests/unit/kernels/backend_conformance.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/kernels/backend_reference.h"

namespace canzona {

using ::canzona::backend_reference::QuinticSpec;
using ::canzona::backend_reference::RandomNormal;
using ::canzona::backend_reference::ShapeName;
using ::canzona::testing::IsOk;
using ::canzona::testing::StatusIs;
using ::testing::HasSubstr;

void BackendConformanceTest::SetUp() {
  const std::string unavailable = GetParam().unavailable();
  if (!unavailable.empty()) GTEST_SKIP() << unavailable;
  ASSERT_OK_AND_ASSIGN(backend_, GetParam().create());
}

DeviceBuffer BackendConformanceTest::Upload(const std::vector<float>& host) {
  absl::StatusOr<DeviceBuffer> buffer =
      backend_->Allocate(static_cast<int64_t>(host.size()));
  EXPECT_THAT(buffer, IsOk());
  if (!buffer.ok()) return DeviceBuffer();
  EXPECT_THAT(
      backend_->CopyFromHost(host.data(), buffer->size(), buffer->data()),
      IsOk());
  return std::move(buffer).value();
}

DeviceBuffer BackendConformanceTest::Zeros(int64_t count) {
  absl::StatusOr<DeviceBuffer> buffer = backend_->Allocate(count);
  EXPECT_THAT(buffer, IsOk());
  return buffer.ok() ? std::move(buffer).value() : DeviceBuffer();
}

std::vector<float> BackendConformanceTest::Download(
    const DeviceBuffer& buffer) {
  return Download(buffer.data(), buffer.size());
}

std::vector<float> BackendConformanceTest::Download(const float* data,
                                                    int64_t count) {
  std::vector<float> host(static_cast<size_t>(count));
  EXPECT_THAT(backend_->CopyToHost(data, count, host.data()), IsOk());
  return host;
}

namespace {

// ---- Memory -----------------------------------------------------------------

TEST_P(BackendConformanceTest, AllocateIsZeroFilled) {
  for (int64_t count : {1, 7, 1000, 4099}) {
    {
      // Dirty a block of the same size first so a reused block must be
      // cleared by Allocate itself.
      DeviceBuffer dirty = Zeros(count);
      ASSERT_OK(backend_->Fill(7.0f, count, dirty.data()));
      ASSERT_OK(backend_->Synchronize());
    }
    ASSERT_OK_AND_ASSIGN(DeviceBuffer buffer, backend_->Allocate(count));
    EXPECT_EQ(buffer.size(), count);
    EXPECT_NE(buffer.data(), nullptr);
    const std::vector<float> host = Download(buffer);
    EXPECT_TRUE(std::all_of(host.begin(), host.end(),
                            [](float x) { return x == 0.0f; }))
        << "count " << count;
  }
}

TEST_P(BackendConformanceTest, AllocateZeroReturnsEmptyBuffer) {
  ASSERT_OK_AND_ASSIGN(DeviceBuffer buffer, backend_->Allocate(0));
  EXPECT_TRUE(buffer.empty());
  EXPECT_EQ(buffer.size(), 0);
}

TEST_P(BackendConformanceTest, AllocateRejectsNegativeAndHugeCounts) {
  EXPECT_THAT(backend_->Allocate(-1),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("Allocate: count must be >= 0")));
  // Byte counts that do not fit in int64_t (2^62 floats would wrap to 0
  // bytes in size_t arithmetic) and 4 EiB, representable but more than any
  // machine has.
  for (int64_t count : {std::numeric_limits<int64_t>::max(), int64_t{1} << 62,
                        int64_t{1} << 60}) {
    EXPECT_THAT(
        backend_->Allocate(count),
        StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("Allocate")))
        << count;
  }
}

TEST_P(BackendConformanceTest, BufferMoveTransfersOwnership) {
  ASSERT_OK_AND_ASSIGN(DeviceBuffer a, backend_->Allocate(5));
  float* data = a.data();
  DeviceBuffer b = std::move(a);
  EXPECT_EQ(b.data(), data);
  EXPECT_EQ(b.size(), 5);
  EXPECT_EQ(a.data(), nullptr);  // NOLINT(bugprone-use-after-move)
  b.Reset();
  EXPECT_TRUE(b.empty());
}

TEST_P(BackendConformanceTest, CopyRoundTripsAndFills) {
  for (int64_t n : {1003, 4099}) {
    SCOPED_TRACE(n);
    const std::vector<float> host = RandomNormal(n, 1 + n);
    DeviceBuffer src = Upload(host);
    DeviceBuffer dst = Zeros(n);
    ASSERT_OK(backend_->Copy(src.data(), n, dst.data()));
    ASSERT_OK(backend_->Synchronize());
    EXPECT_EQ(Download(dst), host);

    // From the second element (unaligned for vector stores) to two before
    // the end: the elements outside [1, n - 2) keep their values.
    ASSERT_OK(backend_->Fill(-2.5f, n - 3, dst.data() + 1));
    const std::vector<float> filled = Download(dst);
    EXPECT_EQ(filled[0], host[0]);
    for (int64_t i = 1; i < n - 2; ++i) ASSERT_EQ(filled[i], -2.5f) << i;
    EXPECT_EQ(filled[n - 2], host[n - 2]);
    EXPECT_EQ(filled[n - 1], host[n - 1]);
  }
}

// Enqueued copies: the device sees the host's values in order with the
// work after them; the host sees a copy back only after Synchronize (the
// device-like backend delivers it there, as a GPU completes it then).
TEST_P(BackendConformanceTest, EnqueuedCopiesLandBySynchronize) {
  const int64_t n = 4099;
  const std::vector<float> values = RandomNormal(n, 17);
  DeviceBuffer device = Zeros(n);
  ASSERT_OK(backend_->EnqueueCopyFromHost(values.data(), n, device.data()));
  ASSERT_OK(backend_->Scale(n, 2.0f, device.data()));
  std::vector<float> host(n, -1.0f);
  ASSERT_OK(backend_->EnqueueCopyToHost(device.data(), n, host.data()));
  // Written after the copy was enqueued: the copy keeps the values before.
  ASSERT_OK(backend_->Fill(0.0f, n, device.data()));
  ASSERT_OK(backend_->Synchronize());
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(host[i], 2.0f * values[i]) << i;
  // Both directions check their ranges like the waiting copies.
  EXPECT_THAT(backend_->EnqueueCopyToHost(device.data(), n + 1, host.data()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("EnqueueCopyToHost")));
  EXPECT_THAT(backend_->EnqueueCopyFromHost(nullptr, 4, device.data()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("EnqueueCopyFromHost: host is null")));
}

TEST_P(BackendConformanceTest, Copy2DCopiesBlockBetweenStrides) {
  struct Case {
    int64_t rows, cols, src_ld, dst_ld;
  };
  for (const Case& c :
       {Case{13, 5, 9, 7}, Case{37, 53, 55, 60}, Case{4, 6, 6, 6}}) {
    SCOPED_TRACE(ShapeName(c.rows, c.cols));
    const std::vector<float> src_host = RandomNormal(c.rows * c.src_ld, 2);
    const std::vector<float> dst_host = RandomNormal(c.rows * c.dst_ld, 3);
    DeviceBuffer src = Upload(src_host);
    DeviceBuffer dst = Upload(dst_host);
    ASSERT_OK(backend_->Copy2D(c.rows, c.cols, src.data(), c.src_ld, dst.data(),
                               c.dst_ld));
    const std::vector<float> out = Download(dst);
    for (int64_t i = 0; i < c.rows; ++i) {
      for (int64_t j = 0; j < c.dst_ld; ++j) {
        const float expected = j < c.cols ? src_host[i * c.src_ld + j]
                                          : dst_host[i * c.dst_ld + j];
        ASSERT_EQ(out[i * c.dst_ld + j], expected) << i << "," << j;
      }
    }
  }
}

// ---- Argument validation ----------------------------------------------------

struct ErrorCase {
  std::string name;
  std::function<absl::Status(Backend&)> call;
  std::string message;  // expected substring
};

TEST_P(BackendConformanceTest, InvalidArgumentsNameMethodAndField) {
  ASSERT_OK_AND_ASSIGN(DeviceBuffer buf, backend_->Allocate(64));
  float* p = buf.data();
  const Transpose kN = Transpose::kNo, kT = Transpose::kYes;
  const NewtonSchulzSpec spec = QuinticSpec();
  const std::vector<ErrorCase> cases = {
      {"copy negative", [&](Backend& b) { return b.Copy(p, -1, p); },
       "Copy: count must be >= 0"},
      {"copy null", [&](Backend& b) { return b.Copy(nullptr, 4, p); },
       "Copy: src is null for 4 elements"},
      {"from host null",
       [&](Backend& b) { return b.CopyFromHost(p, 4, nullptr); },
       "CopyFromHost: dst is null"},
      {"from host null host",
       [&](Backend& b) { return b.CopyFromHost(nullptr, 4, p); },
       "CopyFromHost: host is null for 4 elements"},
      {"to host negative", [&](Backend& b) { return b.CopyToHost(p, -2, p); },
       "CopyToHost: count must be >= 0"},
      {"to host null host",
       [&](Backend& b) { return b.CopyToHost(p, 2, nullptr); },
       "CopyToHost: host is null for 2 elements"},
      {"copy2d ld", [&](Backend& b) { return b.Copy2D(2, 5, p, 5, p + 32, 4); },
       "Copy2D: dst_ld = 4 is smaller than the row length 5"},
      {"copy2d null src",
       [&](Backend& b) { return b.Copy2D(2, 5, nullptr, 5, p + 32, 5); },
       "Copy2D: src is null for 10 elements"},
      {"copy2d negative cols",
       [&](Backend& b) { return b.Copy2D(2, -5, p, 5, p + 32, 5); },
       "Copy2D: cols must be >= 0, got -5"},
      {"fill null", [&](Backend& b) { return b.Fill(1.0f, 3, nullptr); },
       "Fill: dst is null"},
      {"fill negative", [&](Backend& b) { return b.Fill(1.0f, -3, p); },
       "Fill: count must be >= 0"},
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
      {"gemm null c",
       [&](Backend& b) {
         return b.Gemm(kN, kN, 2, 3, 2, 1, p, 2, p, 3, 0, nullptr, 3);
       },
       "Gemm: c is null for 6 elements"},
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
      {"gemm ldb",
       [&](Backend& b) {
         return b.Gemm(kN, kN, 2, 4, 4, 1, p, 4, p, 3, 0, p + 32, 4);
       },
       "Gemm: ldb = 3 is smaller than the row length 4"},
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
      {"batched n",
       [&](Backend& b) {
         return b.GemmStridedBatched(kN, kN, 2, -2, 2, 1, p, 2, 4, p, 2, 4, 0,
                                     p, 2, 4, 2);
       },
       "GemmStridedBatched: n must be >= 0"},
      {"batched null c",  // the whole batch is addressed: 2 x (2 x 2)
       [&](Backend& b) {
         return b.GemmStridedBatched(kN, kN, 2, 2, 2, 1, p, 2, 4, p, 2, 4, 0,
                                     nullptr, 2, 4, 2);
       },
       "GemmStridedBatched: c is null for 8 elements"},
      {"batched ldc",
       [&](Backend& b) {
         return b.GemmStridedBatched(kN, kN, 2, 2, 2, 1, p, 2, 4, p, 2, 4, 0, p,
                                     1, 4, 2);
       },
       "GemmStridedBatched: ldc = 1 is smaller than the row length 2"},
      {"syrk n",
       [&](Backend& b) { return b.Syrk(kN, -1, 2, 1, p, 2, 0, p, 2); },
       "Syrk: n must be >= 0"},
      {"syrk null a",
       [&](Backend& b) { return b.Syrk(kN, 4, 3, 1, nullptr, 3, 0, p, 4); },
       "Syrk: a is null for 12 elements"},
      {"syrk lda",  // A stored n x k = 4 x 3
       [&](Backend& b) { return b.Syrk(kN, 4, 3, 1, p, 2, 0, p + 32, 4); },
       "Syrk: lda = 2 is smaller than the row length 3"},
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
      {"eigen null a",
       [&](Backend& b) {
         return b.SymmetricEigen(3, nullptr, p, EigenPrecision::kFloat32);
       },
       "SymmetricEigen: a is null for 9 elements"},
      {"eigen null values",
       [&](Backend& b) {
         return b.SymmetricEigen(3, p, nullptr, EigenPrecision::kFloat64);
       },
       "SymmetricEigen: eigenvalues is null"},
      {"qr rows", [&](Backend& b) { return b.QrOrthonormalize(-1, 2, p); },
       "QrOrthonormalize: rows must be >= 0"},
      {"qr wide", [&](Backend& b) { return b.QrOrthonormalize(3, 5, p); },
       "QrOrthonormalize: rows must be >= cols for a thin Q, got 3 x 5"},
      {"qr null", [&](Backend& b) { return b.QrOrthonormalize(3, 2, nullptr); },
       "QrOrthonormalize: a is null"},
      {"ns batch",
       [&](Backend& b) { return b.NewtonSchulz(spec, -1, 2, 2, p, p); },
       "NewtonSchulz: batch must be >= 0"},
      {"ns rows",
       [&](Backend& b) { return b.NewtonSchulz(spec, 1, -2, 2, p, p); },
       "NewtonSchulz: rows must be >= 0"},
      {"ns cols",
       [&](Backend& b) { return b.NewtonSchulz(spec, 1, 2, -2, p, p); },
       "NewtonSchulz: cols must be >= 0"},
      {"ns null input",
       [&](Backend& b) { return b.NewtonSchulz(spec, 1, 2, 3, nullptr, p); },
       "NewtonSchulz: input is null for 6 elements"},
      {"ns null output",
       [&](Backend& b) { return b.NewtonSchulz(spec, 2, 2, 2, p, nullptr); },
       "NewtonSchulz: output is null for 8 elements"},
      {"lerp n", [&](Backend& b) { return b.Lerp(-1, p, p, 0.5f, p); },
       "Lerp: n must be >= 0"},
      {"lerp null a",
       [&](Backend& b) { return b.Lerp(4, nullptr, p, 0.5f, p); },
       "Lerp: a is null for 4 elements"},
      {"lerp null b",
       [&](Backend& b) { return b.Lerp(4, p, nullptr, 0.5f, p); },
       "Lerp: b is null for 4 elements"},
      {"lerp null out",
       [&](Backend& b) { return b.Lerp(3, p, p, 0.5f, nullptr); },
       "Lerp: out is null"},
      {"axpby null x", [&](Backend& b) { return b.Axpby(3, 1, nullptr, 1, p); },
       "Axpby: x is null"},
      {"axpby null y", [&](Backend& b) { return b.Axpby(3, 1, p, 1, nullptr); },
       "Axpby: y is null"},
      {"scale n", [&](Backend& b) { return b.Scale(-5, 1, p); },
       "Scale: n must be >= 0"},
      {"scale null", [&](Backend& b) { return b.Scale(5, 1, nullptr); },
       "Scale: x is null for 5 elements"},
      {"ema null v",
       [&](Backend& b) { return b.EmaSquare(3, 0.9f, 0.1f, p, nullptr); },
       "EmaSquare: v is null"},
      {"ema null g",
       [&](Backend& b) { return b.EmaSquare(3, 0.9f, 0.1f, nullptr, p); },
       "EmaSquare: g is null"},
      {"adam direction null m",
       [&](Backend& b) {
         return b.AdamDirection(3, nullptr, 1, p, 1, 1e-8f, p);
       },
       "AdamDirection: m is null"},
      {"adam direction null out",
       [&](Backend& b) {
         return b.AdamDirection(3, p, 1, p, 1, 1e-8f, nullptr);
       },
       "AdamDirection: out is null"},
      {"adamw n",
       [&](Backend& b) {
         return b.AdamWStep(-1, 1e-3f, 0.9f, 0.999f, 1e-8f, 0, 1, p, p, p, p);
       },
       "AdamWStep: n must be >= 0"},
      {"adamw null g",
       [&](Backend& b) {
         return b.AdamWStep(3, 1e-3f, 0.9f, 0.999f, 1e-8f, 0, 1, nullptr, p, p,
                            p);
       },
       "AdamWStep: g is null"},
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
      {"sum squares null",
       [&](Backend& b) { return b.SumSquares(2, nullptr).status(); },
       "SumSquares: x is null"},
      {"all finite null",
       [&](Backend& b) { return b.AllFinite(2, nullptr).status(); },
       "AllFinite: x is null"},
      {"add identity n", [&](Backend& b) { return b.AddIdentity(-1, 1, p); },
       "AddIdentity: n must be >= 0"},
      {"add identity null",
       [&](Backend& b) { return b.AddIdentity(3, 1, nullptr); },
       "AddIdentity: a is null for 9 elements"},
      {"scale columns null d",
       [&](Backend& b) { return b.ScaleColumns(2, 3, nullptr, p); },
       "ScaleColumns: d is null"},
      {"scale columns cols",
       [&](Backend& b) { return b.ScaleColumns(2, -3, p, p); },
       "ScaleColumns: cols must be >= 0"},
      {"column dots null out",
       [&](Backend& b) { return b.ColumnDots(2, 3, p, p, nullptr); },
       "ColumnDots: out is null"},
      {"column dots null b",
       [&](Backend& b) { return b.ColumnDots(2, 3, p, nullptr, p); },
       "ColumnDots: b is null for 6 elements"},
      {"sort columns null keys",
       [&](Backend& b) { return b.SortColumns(2, 4, nullptr, p, p + 32); },
       "SortColumns: keys is null for 4 elements"},
      {"sort columns aliasing",
       [&](Backend& b) { return b.SortColumns(2, 4, p, p, p + 4); },
       "SortColumns: src"},
      {"sort rows negative",
       [&](Backend& b) { return b.SortRows(-4, 2, p, p, p + 32); },
       "SortRows: rows must be >= 0"},
      {"sort rows null dst",
       [&](Backend& b) { return b.SortRows(4, 2, p, p, nullptr); },
       "SortRows: dst is null for 8 elements"},
      {"scale to norm null x",
       [&](Backend& b) {
         return b.ScaleToNorm(3, p, Backend::Norm::kL2, 0, nullptr);
       },
       "ScaleToNorm: x is null for 3 elements"},
      {"scale to norm negative n",
       [&](Backend& b) {
         return b.ScaleToNorm(-3, nullptr, Backend::Norm::kRms, 0, p);
       },
       "ScaleToNorm: n must be >= 0"},
      {"scale to norm norm",
       [&](Backend& b) {
         return b.ScaleToNorm(3, nullptr, static_cast<Backend::Norm>(7), 0, p);
       },
       "ScaleToNorm: norm = 7 is not l2 or rms"},
      {"scale to norm eps",
       [&](Backend& b) {
         return b.ScaleToNorm(3, nullptr, Backend::Norm::kL2, -1, p);
       },
       "ScaleToNorm: eps = -1 must be finite and >= 0"},
      {"lifted power null x",
       [&](Backend& b) { return b.LiftedPower(3, nullptr, 1e-6, -0.25, p); },
       "LiftedPower: x is null for 3 elements"},
      {"lifted power null out",
       [&](Backend& b) { return b.LiftedPower(3, p, 1e-6, -0.25, nullptr); },
       "LiftedPower: out is null for 3 elements"},
      {"lifted power floor",
       [&](Backend& b) { return b.LiftedPower(3, p, std::nan(""), -0.25, p); },
       "LiftedPower: floor = nan must be finite"},
      {"lifted power exponent",
       [&](Backend& b) { return b.LiftedPower(3, p, 1e-6, HUGE_VAL, p); },
       "LiftedPower: exponent = inf must be finite"},
      {"transpose null dst",
       [&](Backend& b) { return b.Transpose2D(2, 3, p, nullptr); },
       "Transpose2D: dst is null"},
      {"transpose rows",
       [&](Backend& b) { return b.Transpose2D(-2, 3, p, p + 32); },
       "Transpose2D: rows must be >= 0"},
  };
  for (const ErrorCase& c : cases) {
    EXPECT_THAT(c.call(*backend_), StatusIs(absl::StatusCode::kInvalidArgument,
                                            HasSubstr(c.message)))
        << c.name;
  }
}

// Validation comes before the empty-call shortcut: an empty call with a bad
// argument is still rejected.
TEST_P(BackendConformanceTest, EmptyCallsAreStillValidated) {
  const Transpose kN = Transpose::kNo;
  Backend& b = *backend_;
  EXPECT_THAT(b.Copy2D(0, 5, nullptr, 4, nullptr, 5),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("Copy2D: src_ld = 4 is smaller")));
  EXPECT_THAT(
      b.Gemm(kN, kN, 0, 3, 0, 1, nullptr, 1, nullptr, 3, 0, nullptr, 2),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("Gemm: ldc = 2 is smaller than the row length 3")));
  EXPECT_THAT(b.GemmStridedBatched(kN, kN, 2, 2, 2, 1, nullptr, 2, -1, nullptr,
                                   2, 4, 0, nullptr, 2, 4, 0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("GemmStridedBatched: stride_a must be >= 0")));
  EXPECT_THAT(b.AdamWStep(0, 1e-3f, 0.9f, 0.999f, 1e-8f, 0, 0, nullptr, nullptr,
                          nullptr, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("AdamWStep: step must be >= 1, got 0")));
  EXPECT_THAT(b.QrOrthonormalize(0, 2, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("QrOrthonormalize: rows must be >= cols")));
  // No rows to move, but three keys to read.
  EXPECT_THAT(b.SortColumns(0, 3, nullptr, nullptr, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("SortColumns: keys is null")));
}

TEST_P(BackendConformanceTest, ZeroSizeCallsAreNoOps) {
  NewtonSchulzSpec empty_spec;  // no coefficients: normalization only
  const NewtonSchulzSpec spec = QuinticSpec();
  const Transpose kN = Transpose::kNo;
  Backend& b = *backend_;
  EXPECT_OK(b.Copy(nullptr, 0, nullptr));
  EXPECT_OK(b.CopyFromHost(nullptr, 0, nullptr));
  EXPECT_OK(b.CopyToHost(nullptr, 0, nullptr));
  EXPECT_OK(b.Copy2D(0, 5, nullptr, 5, nullptr, 5));
  EXPECT_OK(b.Copy2D(3, 0, nullptr, 1, nullptr, 1));
  EXPECT_OK(b.Fill(1.0f, 0, nullptr));
  EXPECT_OK(b.Gemm(kN, kN, 0, 0, 0, 1, nullptr, 1, nullptr, 1, 0, nullptr, 1));
  EXPECT_OK(b.Gemm(kN, kN, 0, 3, 0, 1, nullptr, 1, nullptr, 3, 0, nullptr, 3));
  EXPECT_OK(b.Gemm(kN, kN, 4, 0, 0, 1, nullptr, 1, nullptr, 1, 0, nullptr, 1));
  EXPECT_OK(b.GemmStridedBatched(kN, kN, 2, 2, 2, 1, nullptr, 2, 4, nullptr, 2,
                                 4, 0, nullptr, 2, 4, 0));
  EXPECT_OK(b.Syrk(kN, 0, 4, 1, nullptr, 4, 0, nullptr, 1));
  EXPECT_OK(b.SymmetricEigen(0, nullptr, nullptr, EigenPrecision::kFloat32));
  EXPECT_OK(b.SymmetricEigen(0, nullptr, nullptr, EigenPrecision::kFloat64));
  EXPECT_OK(b.QrOrthonormalize(0, 0, nullptr));
  EXPECT_OK(b.QrOrthonormalize(5, 0, nullptr));
  EXPECT_OK(b.NewtonSchulz(spec, 0, 4, 4, nullptr, nullptr));
  EXPECT_OK(b.NewtonSchulz(spec, 3, 0, 4, nullptr, nullptr));
  EXPECT_OK(b.NewtonSchulz(empty_spec, 0, 16, 16, nullptr, nullptr));
  EXPECT_OK(b.Lerp(0, nullptr, nullptr, 0.5f, nullptr));
  EXPECT_OK(b.Axpby(0, 1, nullptr, 1, nullptr));
  EXPECT_OK(b.Scale(0, 1, nullptr));
  EXPECT_OK(b.EmaSquare(0, 1, 1, nullptr, nullptr));
  EXPECT_OK(b.AdamDirection(0, nullptr, 1, nullptr, 1, 1, nullptr));
  EXPECT_OK(b.AdamWStep(0, 1e-3f, 0.9f, 0.999f, 1e-8f, 0, 1, nullptr, nullptr,
                        nullptr, nullptr));
  ASSERT_OK_AND_ASSIGN(double sum, b.SumSquares(0, nullptr));
  EXPECT_EQ(sum, 0.0);
  ASSERT_OK_AND_ASSIGN(bool finite, b.AllFinite(0, nullptr));
  EXPECT_TRUE(finite);
  EXPECT_OK(b.AddIdentity(0, 1, nullptr));
  EXPECT_OK(b.ScaleColumns(0, 0, nullptr, nullptr));
  // d is read only when some row is scaled.
  EXPECT_OK(b.ScaleColumns(0, 3, nullptr, nullptr));
  EXPECT_OK(b.ColumnDots(0, 0, nullptr, nullptr, nullptr));
  EXPECT_OK(b.SortColumns(0, 0, nullptr, nullptr, nullptr));
  EXPECT_OK(b.SortRows(0, 0, nullptr, nullptr, nullptr));
  EXPECT_OK(b.Transpose2D(0, 7, nullptr, nullptr));
  EXPECT_OK(b.Synchronize());
}

}  // namespace
}  // namespace canzona
