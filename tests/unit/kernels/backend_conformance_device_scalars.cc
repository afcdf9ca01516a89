// Conformance: the entry points that keep a scalar decision on the backend
// instead of reading it on the host (ScaleToNorm's ratio, LiftedPower's
// minimum, SortColumns' and SortRows' order). Each is held bitwise to the host
// round trip it replaces (sums or keys read on the host, then Scale or a
// Gather), checked against float64 or an independent host sort on fresh random
// data, and must not wait (host_waits: on a GPU each wait idles the device).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/kernels/backend_conformance.h"
#include "tests/unit/kernels/backend_reference.h"

namespace canzona {
namespace {

using ::canzona::backend_reference::RandomNormal;

double SumOfSquares(const float* x, int64_t n) {
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += double{x[i]} * x[i];
  return sum;
}

// Sizes: one element, a vector-width tail, odd mid sizes, a grid-stride
// size (every reduction block loops); offset 1 misaligns every pointer.
TEST_P(BackendConformanceTest, ScaleToNormIsScaleByTheRatioOfTwoSums) {
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1003}, int64_t{65537},
                    int64_t{1} << 20}) {
    for (int64_t offset : {0, 1}) {
      for (Backend::Norm norm : {Backend::Norm::kL2, Backend::Norm::kRms}) {
        for (int with : {0, 1, 2}) {  // no reference, another vector, x
          SCOPED_TRACE(absl::StrCat("n=", n, " offset=", offset,
                                    " rms=", norm == Backend::Norm::kRms,
                                    " reference=", with));
          const std::vector<float> x =
              RandomNormal(n + offset, 9100 + n, 0.1f, 2.0f);
          const std::vector<float> r =
              RandomNormal(n + offset, 9200 + n, 0.0f, 0.3f);
          const double eps = norm == Backend::Norm::kRms ? 1e-30 : 1e-16;
          DeviceBuffer dx = Upload(x), dr = Upload(r), expected = Upload(x);
          float* px = dx.data() + offset;
          const float* reference = with == 0   ? nullptr
                                   : with == 1 ? dr.data() + offset
                                               : px;
          // The host round trips it replaces, on this backend.
          const double divisor =
              norm == Backend::Norm::kRms ? static_cast<double>(n) : 1.0;
          double numerator = 1.0;
          if (reference != nullptr) {
            ASSERT_OK_AND_ASSIGN(const double sum,
                                 backend_->SumSquares(n, reference));
            numerator = std::sqrt(sum / divisor);
          }
          ASSERT_OK_AND_ASSIGN(const double sum, backend_->SumSquares(n, px));
          const double ratio = numerator / (std::sqrt(sum / divisor) + eps);
          ASSERT_OK(backend_->Scale(n, static_cast<float>(ratio),
                                    expected.data() + offset));

          const int64_t waits = backend_->host_waits();
          ASSERT_OK(backend_->ScaleToNorm(n, reference, norm, eps, px));
          EXPECT_EQ(backend_->host_waits(), waits) << "waited on the host";
          const std::vector<float> out = Download(px, n);
          ASSERT_EQ(out, Download(expected.data() + offset, n));

          // Against float64: each element is x's times the exact ratio
          // within a few roundings, and the result has the size asked for.
          const double x_size =
              std::sqrt(SumOfSquares(x.data() + offset, n) / divisor);
          const double want =
              with == 0
                  ? 1.0
                  : std::sqrt(
                        SumOfSquares((with == 1 ? r : x).data() + offset, n) /
                        divisor);
          const double exact = want / (x_size + eps);
          for (int64_t i = 0; i < n; ++i) {
            ASSERT_NEAR(out[i], x[i + offset] * exact,
                        1e-6 * std::abs(x[i + offset] * exact))
                << i;
          }
          EXPECT_NEAR(std::sqrt(SumOfSquares(out.data(), n) / divisor), want,
                      1e-5 * want);
        }
      }
    }
  }
}

// LiftedPower against float64 on eigenvalue-like data: all above the floor
// (no lift), some below it and negative (lifted), one NaN (ignored by the
// minimum, NaN where it stands); sizes around the one block's 256 threads;
// in place too. Every result within one float32 rounding of the exact
// power (the device's double pow is within 2 ulp of double), no host wait.
TEST_P(BackendConformanceTest, LiftedPowerLiftsTheSmallestToTheFloor) {
  const double floor = 1e-6;
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{255}, int64_t{256},
                    int64_t{257}, int64_t{4099}}) {
    for (int lifted : {0, 1, 2}) {  // above the floor, below it, a NaN too
      for (double exponent : {-0.25, 0.5}) {
        for (bool in_place : {false, true}) {
          SCOPED_TRACE(absl::StrCat("n=", n, " lifted=", lifted, " exponent=",
                                    exponent, " in_place=", in_place));
          std::vector<float> x = RandomNormal(n, 9300 + n + lifted, 0.0f, 1.0f);
          for (float& v : x) v = lifted == 0 ? v * v + 1e-3f : v * 2e-3f;
          if (lifted == 2) x[n / 2] = std::numeric_limits<float>::quiet_NaN();
          double lowest = std::numeric_limits<double>::infinity();
          for (float v : x) {
            if (!std::isnan(v)) lowest = std::min<double>(lowest, v);
          }
          DeviceBuffer dx = Upload(x), dout = Zeros(n);
          float* out = in_place ? dx.data() : dout.data();
          const int64_t waits = backend_->host_waits();
          ASSERT_OK(backend_->LiftedPower(n, dx.data(), floor, exponent, out));
          EXPECT_EQ(backend_->host_waits(), waits) << "waited on the host";
          const std::vector<float> got = Download(out, n);
          for (int64_t i = 0; i < n; ++i) {
            if (std::isnan(x[i])) {
              EXPECT_TRUE(std::isnan(got[i])) << i;
              continue;
            }
            const double v =
                lowest < floor ? double{x[i]} - lowest + floor : x[i];
            const double want = std::pow(v, exponent);
            ASSERT_NEAR(got[i], want, 1.2e-7 * std::abs(want))
                << i << ": x=" << x[i] << " lowest=" << lowest;
          }
        }
      }
    }
  }
}

// The order SortColumns and SortRows define, written independently of the
// backends': descending, NaN last, equal keys (+0 and -0 too) by index.
std::vector<int64_t> StableDescendingOrder(const std::vector<float>& keys) {
  std::vector<int64_t> order(keys.size());
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    const float ka = keys[a], kb = keys[b];
    if (std::isnan(ka) || std::isnan(kb))
      return !std::isnan(ka) && std::isnan(kb);
    return ka > kb;
  });
  return order;
}

// n keys with ties (values on a coarse grid), both zeros and, with `nan`,
// NaNs: what a sort by index or by value alone would get wrong.
std::vector<float> KeysWithTies(int64_t n, uint32_t seed, bool nan) {
  std::vector<float> keys = RandomNormal(n, seed);
  for (float& k : keys) k = std::round(k * 4.0f) / 4.0f;
  for (int64_t i = 0; i < n; i += 5) keys[i] = (i / 5) % 2 ? 0.0f : -0.0f;
  if (nan) {
    for (int64_t i = 3; i < n; i += 11) {
      keys[i] = std::numeric_limits<float>::quiet_NaN();
    }
  }
  return keys;
}

// Shapes cross the 256-key tiles a GPU sorts in and its 2-D blocks.
TEST_P(BackendConformanceTest,
       SortColumnsAndRowsGatherByAStableDescendingSort) {
  const struct {
    int64_t rows, cols;
  } shapes[] = {{1, 1},   {1, 7},   {7, 1},   {13, 5},   {5, 13},
                {64, 64}, {37, 53}, {300, 5}, {3, 1030}, {1030, 3}};
  for (const auto& s : shapes) {
    for (bool nan : {false, true}) {
      SCOPED_TRACE(absl::StrCat(s.rows, "x", s.cols, " nan=", nan));
      const int64_t count = s.rows * s.cols;
      const std::vector<float> src = RandomNormal(count, 9300 + count);
      const std::vector<float> col_keys =
          KeysWithTies(s.cols, 9400 + s.cols, nan);
      const std::vector<float> row_keys =
          KeysWithTies(s.rows, 9500 + s.rows, nan);
      DeviceBuffer dsrc = Upload(src), ddst = Zeros(count);
      DeviceBuffer dcol_keys = Upload(col_keys), drow_keys = Upload(row_keys);

      int64_t waits = backend_->host_waits();
      ASSERT_OK(backend_->SortColumns(s.rows, s.cols, dcol_keys.data(),
                                      dsrc.data(), ddst.data()));
      EXPECT_EQ(backend_->host_waits(), waits) << "waited on the host";
      std::vector<float> out = Download(ddst);
      const std::vector<int64_t> col_order = StableDescendingOrder(col_keys);
      for (int64_t i = 0; i < s.rows; ++i) {
        for (int64_t j = 0; j < s.cols; ++j) {
          ASSERT_EQ(out[i * s.cols + j], src[i * s.cols + col_order[j]])
              << i << ", " << j;
        }
      }

      waits = backend_->host_waits();
      ASSERT_OK(backend_->SortRows(s.rows, s.cols, drow_keys.data(),
                                   dsrc.data(), ddst.data()));
      EXPECT_EQ(backend_->host_waits(), waits) << "waited on the host";
      out = Download(ddst);
      const std::vector<int64_t> row_order = StableDescendingOrder(row_keys);
      for (int64_t i = 0; i < s.rows; ++i) {
        for (int64_t j = 0; j < s.cols; ++j) {
          ASSERT_EQ(out[i * s.cols + j], src[row_order[i] * s.cols + j])
              << i << ", " << j;
        }
      }
    }
  }
}

}  // namespace
}  // namespace canzona
