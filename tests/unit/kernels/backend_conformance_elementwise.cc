// Conformance: the fused elementwise kernels, the reductions and the matrix
// helpers against float64 references. Sizes cover a single element, a
// vector-width tail (7), odd mid sizes and grid-stride sizes; offset 1
// makes every pointer unaligned for vector loads.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/base/status_macros.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/kernels/backend_conformance.h"
#include "tests/unit/kernels/backend_reference.h"

namespace canzona {
namespace {

using ::canzona::backend_reference::RandomNormal;
using ::canzona::backend_reference::RandomPermutation;
using ::canzona::backend_reference::Shape;
using ::canzona::backend_reference::ShapeName;
using ::canzona::testing::StatusIs;
using ::testing::HasSubstr;

const int64_t kSizes[] = {1, 7, 1003, 65537, int64_t{1} << 20};
const int64_t kOffsets[] = {0, 1};

// The 1e-6 bounds below are a few float32 roundings (2^-24 = 6e-8 each)
// relative to the magnitude of the terms: any evaluation order, with or
// without fused multiply-adds, stays inside them.

TEST_P(BackendConformanceTest, LerpMatchesReferenceAndEndpoints) {
  for (int64_t n : kSizes) {
    for (int64_t offset : kOffsets) {
      const std::vector<float> a = RandomNormal(n + offset, 1000 + n);
      const std::vector<float> b = RandomNormal(n + offset, 2000 + n);
      for (float w : {0.0f, 0.3f, 0.5f, 0.7f, 1.0f, -0.25f, 1.5f, -0.7f}) {
        SCOPED_TRACE(absl::StrCat("n=", n, " offset=", offset, " w=", w));
        DeviceBuffer da = Upload(a), db = Upload(b), dout = Zeros(n + offset);
        ASSERT_OK(backend_->Lerp(n, da.data() + offset, db.data() + offset, w,
                                 dout.data() + offset));
        const std::vector<float> out = Download(dout.data() + offset, n);
        for (int64_t i = 0; i < n; ++i) {
          const float ai = a[i + offset], bi = b[i + offset];
          const double ref = ai + double{w} * (double{bi} - ai);
          ASSERT_NEAR(out[i], ref, 1e-6 * (std::abs(ai) + std::abs(bi))) << i;
          // torch.lerp's formulas are exact at their endpoint.
          if (w == 0.0f) {
            ASSERT_EQ(out[i], ai) << i;
          }
          if (w == 1.0f) {
            ASSERT_EQ(out[i], bi) << i;
          }
        }
        // Output aliasing the first input.
        ASSERT_OK(backend_->Lerp(n, da.data() + offset, db.data() + offset, w,
                                 da.data() + offset));
        EXPECT_EQ(Download(da.data() + offset, n), out);
      }
    }
  }
}

// Muon's Nesterov momentum in one pass: bit for bit the two Lerps it
// replaces, within float rounding of a float64 reference, on fresh data,
// aligned and not, with the output aliasing the gradient (an in-place
// caller) too.
TEST_P(BackendConformanceTest, NesterovMomentumIsTheTwoLerps) {
  for (int64_t n : kSizes) {
    for (int64_t offset : kOffsets) {
      for (float beta : {0.95f, 0.9f, 0.3f}) {
        SCOPED_TRACE(absl::StrCat("n=", n, " offset=", offset, " beta=", beta));
        const std::vector<float> g = RandomNormal(n + offset, 4100 + n);
        const std::vector<float> m = RandomNormal(n + offset, 4200 + n);
        // The two Lerps.
        DeviceBuffer dg = Upload(g), dm = Upload(m), dout = Zeros(n + offset);
        ASSERT_OK(backend_->Lerp(n, dm.data() + offset, dg.data() + offset,
                                 1.0f - beta, dm.data() + offset));
        ASSERT_OK(backend_->Lerp(n, dg.data() + offset, dm.data() + offset,
                                 beta, dout.data() + offset));
        const std::vector<float> want_m = Download(dm.data() + offset, n);
        const std::vector<float> want = Download(dout.data() + offset, n);
        // Fused.
        DeviceBuffer fg = Upload(g), fm = Upload(m), fout = Zeros(n + offset);
        ASSERT_OK(backend_->NesterovMomentum(n, beta, fg.data() + offset,
                                             fm.data() + offset,
                                             fout.data() + offset));
        EXPECT_EQ(Download(fm.data() + offset, n), want_m);
        EXPECT_EQ(Download(fout.data() + offset, n), want);
        for (int64_t i = 0; i < n; i += std::max<int64_t>(1, n / 97)) {
          const double gi = g[i + offset], mi = m[i + offset];
          const double m_ref = beta * mi + (1.0 - beta) * gi;
          const double ref = (1.0 - beta) * gi + beta * m_ref;
          ASSERT_NEAR(want[i], ref, 1e-6 * (std::abs(gi) + std::abs(mi))) << i;
        }
        // In place over the gradient.
        DeviceBuffer ig = Upload(g), im = Upload(m);
        ASSERT_OK(backend_->NesterovMomentum(n, beta, ig.data() + offset,
                                             im.data() + offset,
                                             ig.data() + offset));
        EXPECT_EQ(Download(ig.data() + offset, n), want);
        EXPECT_EQ(Download(im.data() + offset, n), want_m);
        // In place over the momentum (the output wins).
        DeviceBuffer ag = Upload(g), am = Upload(m);
        ASSERT_OK(backend_->NesterovMomentum(n, beta, ag.data() + offset,
                                             am.data() + offset,
                                             am.data() + offset));
        EXPECT_EQ(Download(am.data() + offset, n), want);
      }
    }
  }
  EXPECT_THAT(backend_->NesterovMomentum(4, 0.9f, nullptr, nullptr, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("NesterovMomentum: grad is null")));
}

TEST_P(BackendConformanceTest, AxpbyScaleEmaSquareAdamDirection) {
  for (int64_t n : kSizes) {
    for (int64_t offset : kOffsets) {
      SCOPED_TRACE(absl::StrCat("n=", n, " offset=", offset));
      const int64_t size = n + offset;
      const std::vector<float> x = RandomNormal(size, 3000 + n);
      const std::vector<float> y = RandomNormal(size, 4000 + n);
      std::vector<float> v0 = RandomNormal(size, 5000 + n);
      for (float& e : v0) e = e * e;  // second moments are positive

      DeviceBuffer dx = Upload(x), dy = Upload(y);
      ASSERT_OK(backend_->Axpby(n, 0.3f, dx.data() + offset, -1.7f,
                                dy.data() + offset));
      std::vector<float> out = Download(dy.data() + offset, n);
      for (int64_t i = 0; i < n; ++i) {
        const float xi = x[i + offset], yi = y[i + offset];
        const double ref = 0.3 * xi + (-1.7) * double{yi};
        ASSERT_NEAR(out[i], ref,
                    1e-6 * (0.3 * std::abs(xi) + 1.7 * std::abs(yi)));
      }

      dy = Upload(y);
      ASSERT_OK(backend_->Scale(n, -0.37f, dy.data() + offset));
      out = Download(dy.data() + offset, n);
      for (int64_t i = 0; i < n; ++i) {
        const float yi = y[i + offset];
        ASSERT_NEAR(out[i], -0.37 * yi, 1e-6 * std::abs(0.37 * yi));
      }

      DeviceBuffer dv = Upload(v0);
      ASSERT_OK(backend_->EmaSquare(n, 0.95f, 0.05f, dx.data() + offset,
                                    dv.data() + offset));
      out = Download(dv.data() + offset, n);
      for (int64_t i = 0; i < n; ++i) {
        const float xi = x[i + offset];
        const double ref = 0.95 * v0[i + offset] + 0.05 * double{xi} * xi;
        ASSERT_NEAR(out[i], ref, 1e-6 * ref);
      }

      DeviceBuffer dm = Upload(x), dout = Zeros(size);
      dv = Upload(v0);
      ASSERT_OK(backend_->AdamDirection(n, dm.data() + offset, 1.25f,
                                        dv.data() + offset, 3.0f, 1e-3f,
                                        dout.data() + offset));
      out = Download(dout.data() + offset, n);
      for (int64_t i = 0; i < n; ++i) {
        const double ref = 1.25 * x[i + offset] /
                           (std::sqrt(3.0 * v0[i + offset]) + double{1e-3f});
        ASSERT_NEAR(out[i], ref, 1e-6 * std::abs(ref));
      }
    }
  }
}

TEST_P(BackendConformanceTest, AxpbyWithZeroBetaKeepsNonFiniteY) {
  // Unlike BLAS's axpby, beta == 0 still reads y: a NaN or Inf in y is never
  // silently dropped.
  const int64_t n = 1003;
  const std::vector<float> x = RandomNormal(n, 3500);
  std::vector<float> y = RandomNormal(n, 3501);
  y[3] = std::numeric_limits<float>::quiet_NaN();
  y[600] = std::numeric_limits<float>::infinity();
  DeviceBuffer dx = Upload(x), dy = Upload(y);
  ASSERT_OK(backend_->Axpby(n, 2.0f, dx.data(), 0.0f, dy.data()));
  const std::vector<float> out = Download(dy);
  EXPECT_TRUE(std::isnan(out[3]));
  EXPECT_TRUE(std::isnan(out[600]));  // 0 * Inf
  EXPECT_EQ(out[4], 2.0f * x[4]);
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

TEST_P(BackendConformanceTest, AdamWStepMatchesTorchOrderReference) {
  // Default betas, and beta1 < 0.5 (lerp takes its large-weight branch).
  const AdamWConfig configs[] = {{1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f},
                                 {3e-2f, 0.3f, 0.95f, 1e-6f, 0.1f}};
  for (const AdamWConfig& c : configs) {
    for (int64_t n : {int64_t{1003}, int64_t{65537}}) {
      for (int64_t offset : kOffsets) {
        SCOPED_TRACE(absl::StrCat("lr=", c.lr, " beta1=", c.beta1, " n=", n,
                                  " offset=", offset));
        const int64_t size = n + offset;
        const std::vector<float> p0 = RandomNormal(size, 6000);
        std::vector<AdamWState> ref(n), mag(n);
        for (int64_t i = 0; i < n; ++i) {
          ref[i] = {p0[i + offset], 0.0, 0.0};
          mag[i] = {std::abs(p0[i + offset]), 0.0, 0.0};
        }
        DeviceBuffer dp = Upload(p0), dm = Zeros(size), dv = Zeros(size);
        for (int64_t step = 1; step <= 10; ++step) {
          const std::vector<float> g = RandomNormal(size, 6000 + step);
          DeviceBuffer dg = Upload(g);
          ASSERT_OK(backend_->AdamWStep(
              n, c.lr, c.beta1, c.beta2, c.eps, c.weight_decay, step,
              dg.data() + offset, dp.data() + offset, dm.data() + offset,
              dv.data() + offset));
          for (int64_t i = 0; i < n; ++i) {
            AdamWReference(c, step, g[i + offset], ref[i], mag[i]);
          }
        }
        const std::vector<float> got_p = Download(dp.data() + offset, n);
        const std::vector<float> got_m = Download(dm.data() + offset, n);
        const std::vector<float> got_v = Download(dv.data() + offset, n);
        for (int64_t i = 0; i < n; ++i) {
          // 1e-6 relative to the magnitude of the terms that were summed
          // (equal to |value| unless terms cancelled). The torch-order
          // float loop peaks at 6.6e-7 on this data, with or without fused
          // multiply-adds.
          ASSERT_NEAR(got_p[i], ref[i].p, 1e-6 * mag[i].p) << i;
          ASSERT_NEAR(got_m[i], ref[i].m, 1e-6 * mag[i].m) << i;
          ASSERT_NEAR(got_v[i], ref[i].v, 1e-6 * mag[i].v) << i;
        }
      }
    }
  }
}

TEST_P(BackendConformanceTest, AdamWStepFromRandomStateAtStepOneAndTen) {
  // One step from arbitrary moments (not the zeros a fresh optimizer
  // starts from), early and later in the bias correction.
  const AdamWConfig c = {1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f};
  const int64_t n = 65537;
  for (int64_t step : {1, 10}) {
    SCOPED_TRACE(absl::StrCat("step=", step));
    const std::vector<float> g = RandomNormal(n, 6200 + step);
    const std::vector<float> p0 = RandomNormal(n, 6210 + step);
    const std::vector<float> m0 = RandomNormal(n, 6220 + step);
    std::vector<float> v0 = RandomNormal(n, 6230 + step);
    for (float& e : v0) e = std::abs(e) + 0.01f;
    DeviceBuffer dg = Upload(g), dp = Upload(p0), dm = Upload(m0),
                 dv = Upload(v0);
    ASSERT_OK(backend_->AdamWStep(n, c.lr, c.beta1, c.beta2, c.eps,
                                  c.weight_decay, step, dg.data(), dp.data(),
                                  dm.data(), dv.data()));
    const std::vector<float> got_p = Download(dp), got_m = Download(dm),
                             got_v = Download(dv);
    for (int64_t i = 0; i < n; ++i) {
      AdamWState ref = {p0[i], m0[i], v0[i]};
      AdamWState mag = {std::abs(p0[i]), std::abs(m0[i]), v0[i]};
      AdamWReference(c, step, g[i], ref, mag);
      ASSERT_NEAR(got_p[i], ref.p, 1e-6 * mag.p) << i;
      ASSERT_NEAR(got_m[i], ref.m, 1e-6 * mag.m) << i;
      ASSERT_NEAR(got_v[i], ref.v, 1e-6 * mag.v) << i;
    }
  }
}

// One group's AdamW tensors in one call: bitwise AdamWStep on each, every
// change sum queued as its own call queues it (TakeSumSquares adds them in
// the same order): more non-empty tensors than one cuda launch takes (64),
// misaligned (offset) and empty ones, one large enough that each thread
// loops (more elements than 1024 blocks of 256 threads take four at a
// time), and a queue nearly full before each call (so a misplaced slot
// loses a queued sum, and the queue drains mid-call), over several steps.
TEST_P(BackendConformanceTest, AdamWStepManyEqualsAdamWStepEach) {
  const AdamWConfig c = {1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f};
  std::vector<int64_t> ns;
  for (int k = 0; k < 90; ++k) {
    const int64_t sizes[] = {128, 1024, 1, 7, 1003, 65537, 0};
    ns.push_back(sizes[k % 7]);
  }
  ns[40] = (int64_t{1} << 20) * 5 / 4 + 3;
  // Sums queued before each call: they must come out in the total.
  const std::vector<float> filler = RandomNormal(33, 8999, 0.0f, 3.0f);
  DeviceBuffer dfiller = Upload(filler);
  auto fill_queue = [&]() -> absl::Status {
    for (int i = 0; i < 1000; ++i) {
      CANZONA_RETURN_IF_ERROR(
          backend_->EnqueueSumSquares(1 + i % 33, dfiller.data()));
    }
    return absl::OkStatus();
  };
  // Two copies of every tensor's state: one stepped by AdamWStepMany, one
  // by AdamWStep each.
  struct Copy {
    std::vector<DeviceBuffer> g, p, m, v;
    std::vector<Backend::AdamWTensor> tensors;
  };
  Copy many, each;
  for (Copy* copy : {&many, &each}) {
    for (size_t k = 0; k < ns.size(); ++k) {
      const int64_t offset = kOffsets[k % 2];
      const int64_t size = ns[k] + 2;  // room for either offset
      const uint32_t seed = 9000 + 10 * static_cast<uint32_t>(k);
      copy->p.push_back(Upload(RandomNormal(size, seed)));
      copy->m.push_back(Upload(RandomNormal(size, seed + 1)));
      std::vector<float> v = RandomNormal(size, seed + 2);
      for (float& e : v) e = std::abs(e) + 0.01f;
      copy->v.push_back(Upload(v));
      copy->g.push_back(Zeros(size));
      copy->tensors.push_back(
          {ns[k], copy->g[k].data() + offset, copy->p[k].data() + offset,
           copy->m[k].data() + offset, copy->v[k].data() + offset});
    }
  }
  for (int64_t step = 1; step <= 3; ++step) {
    SCOPED_TRACE(absl::StrCat("step ", step));
    const SquaredChange change =
        step == 2 ? SquaredChange::kIgnore : SquaredChange::kQueue;
    for (size_t k = 0; k < ns.size(); ++k) {
      const std::vector<float> g = RandomNormal(
          ns[k] + 2, 9500 + 10 * static_cast<uint32_t>(k + 100 * step));
      for (Copy* copy : {&many, &each}) {
        ASSERT_OK(
            backend_->CopyFromHost(g.data(), ns[k] + 2, copy->g[k].data()));
      }
    }
    ASSERT_OK(fill_queue());
    ASSERT_OK(backend_->AdamWStepMany(many.tensors, c.lr, c.beta1, c.beta2,
                                      c.eps, c.weight_decay, step, change));
    ASSERT_OK_AND_ASSIGN(const double many_sum, backend_->TakeSumSquares());
    ASSERT_OK(fill_queue());
    for (const Backend::AdamWTensor& t : each.tensors) {
      ASSERT_OK(backend_->AdamWStep(t.n, c.lr, c.beta1, c.beta2, c.eps,
                                    c.weight_decay, step, t.g, t.p, t.m, t.v,
                                    change));
    }
    ASSERT_OK_AND_ASSIGN(const double each_sum, backend_->TakeSumSquares());
    EXPECT_EQ(many_sum, each_sum);
    if (change == SquaredChange::kQueue) EXPECT_GT(many_sum, 0);
    for (size_t k = 0; k < ns.size(); ++k) {
      SCOPED_TRACE(absl::StrCat("tensor ", k, " of ", ns[k]));
      EXPECT_EQ(Download(many.p[k]), Download(each.p[k]));
      EXPECT_EQ(Download(many.m[k]), Download(each.m[k]));
      EXPECT_EQ(Download(many.v[k]), Download(each.v[k]));
    }
  }
  // A bad tensor is named, and nothing is written.
  const std::vector<float> before = Download(many.p[2]);
  std::vector<Backend::AdamWTensor> bad = many.tensors;
  bad[3].p = many.p[3].data() + 3;  // runs past its allocation
  EXPECT_THAT(
      backend_->AdamWStepMany(bad, c.lr, c.beta1, c.beta2, c.eps,
                              c.weight_decay, 4),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tensors[3].p")));
  EXPECT_THAT(backend_->AdamWStepMany(many.tensors, c.lr, c.beta1, c.beta2,
                                      c.eps, c.weight_decay, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("step")));
  EXPECT_EQ(Download(many.p[2]), before);
}

TEST_P(BackendConformanceTest, SumSquaresAccumulatesInDouble) {
  // 2^20 values near 1: a float accumulator would be off by ~1e-4 relative.
  const int64_t n = (int64_t{1} << 20) + 3;
  const std::vector<float> x = RandomNormal(n, 7000, 1.0f, 0.5f);
  DeviceBuffer dx = Upload(x);
  for (int64_t offset : kOffsets) {
    long double ref = 0.0L;
    for (int64_t i = offset; i < n; ++i) {
      ref += static_cast<long double>(x[i]) * x[i];
    }
    ASSERT_OK_AND_ASSIGN(double got,
                         backend_->SumSquares(n - offset, dx.data() + offset));
    EXPECT_NEAR(got, static_cast<double>(ref), 1e-12 * static_cast<double>(ref))
        << "offset " << offset;
  }
  for (int64_t small : {0, 1, 7}) {
    double r = 0.0;
    for (int64_t i = 0; i < small; ++i) r += double{x[i]} * x[i];
    ASSERT_OK_AND_ASSIGN(double s, backend_->SumSquares(small, dx.data()));
    EXPECT_DOUBLE_EQ(s, r) << small;
  }
}

// Several vectors in one call (the step's norm pass): each sum bitwise the
// one SumSquares gives, against a long-double reference on fresh data; an
// empty vector sums to 0 and a non-finite element shows in its own sum only.
// The last vector starts one float into the first one's buffer (not
// 16-byte aligned: cuda's scalar path), and empty ones lie between and
// after the others (cuda: vectors without reduction blocks).
TEST_P(BackendConformanceTest, SumSquaresManyEqualsSumSquaresEach) {
  std::vector<int64_t> ns = {1003, 0, 7, (int64_t{1} << 16) + 5, 1, 0};
  std::vector<DeviceBuffer> buffers;
  std::vector<std::vector<float>> hosts;
  std::vector<const float*> xs;
  for (size_t k = 0; k < ns.size(); ++k) {
    hosts.push_back(RandomNormal(std::max<int64_t>(ns[k], 1),
                                 7300 + static_cast<uint32_t>(k), 0.5f, 2.0f));
    if (k == 3) hosts[k][ns[k] / 2] = std::numeric_limits<float>::infinity();
    buffers.push_back(Upload(hosts[k]));
    xs.push_back(buffers.back().data());
  }
  ns.push_back(ns[0] - 1);
  xs.push_back(xs[0] + 1);
  hosts.emplace_back(hosts[0].begin() + 1, hosts[0].end());
  std::vector<double> sums(ns.size(), -1.0);
  ASSERT_OK(backend_->SumSquaresMany(xs, ns, absl::MakeSpan(sums)));
  for (size_t k = 0; k < ns.size(); ++k) {
    ASSERT_OK_AND_ASSIGN(double one, backend_->SumSquares(ns[k], xs[k]));
    if (k == 3) {
      EXPECT_TRUE(std::isinf(sums[k]));
      continue;
    }
    EXPECT_EQ(sums[k], one) << k;  // bitwise, 0 for the empty one
    long double ref = 0.0L;
    for (int64_t i = 0; i < ns[k]; ++i) {
      ref += static_cast<long double>(hosts[k][i]) * hosts[k][i];
    }
    EXPECT_NEAR(sums[k], static_cast<double>(ref),
                1e-12 * static_cast<double>(ref))
        << k;
  }
  EXPECT_GT(sums[0], 0.0);
  // Mismatched sizes and a bad count name the field; nothing is written.
  const absl::Span<const float* const> five(xs.data(), 5);
  const absl::Span<double> five_sums = absl::MakeSpan(sums).subspan(0, 5);
  std::vector<double> two(2, -1.0);
  EXPECT_THAT(
      backend_->SumSquaresMany(five, absl::MakeConstSpan(ns).subspan(0, 5),
                               absl::MakeSpan(two)),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("SumSquaresMany: ns has 5 and out 2")));
  const std::vector<int64_t> bad = {1003, -1, 7, 5, 1};
  EXPECT_THAT(backend_->SumSquaresMany(five, bad, five_sums),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("SumSquaresMany: ns[1] must be >= 0")));
  const std::vector<int64_t> past = {1004, 0, 7, 5, 1};
  EXPECT_THAT(backend_->SumSquaresMany(five, past, five_sums),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("SumSquaresMany: xs[0]")));
}

// Queued sums: the total is the SumSquares of each, added in queue order,
// bitwise, across more sums than the cuda backend queues on the device at
// once (1024); the vector may be overwritten right after it is queued.
TEST_P(BackendConformanceTest, QueuedSumSquaresAddUpInOrder) {
  ASSERT_OK_AND_ASSIGN(double none, backend_->TakeSumSquares());
  EXPECT_EQ(none, 0.0);
  const int64_t n = 257;
  const std::vector<float> host = RandomNormal(n * 3, 7400, 0.5f, 2.0f);
  DeviceBuffer values = Upload(host);
  DeviceBuffer scratch = Zeros(n);
  double expected = 0;
  long double reference = 0;
  for (int k = 0; k < 1100; ++k) {
    const float* x = values.data() + (k % 3) * n;
    ASSERT_OK_AND_ASSIGN(double one, backend_->SumSquares(n, x));
    expected += one;
    for (int64_t i = 0; i < n; ++i) {
      const long double v = host[(k % 3) * n + i];
      reference += v * v;
    }
    ASSERT_OK(backend_->Copy(x, n, scratch.data()));
    ASSERT_OK(backend_->EnqueueSumSquares(n, scratch.data()));
    ASSERT_OK(backend_->Fill(-1.0f, n, scratch.data()));
  }
  ASSERT_OK_AND_ASSIGN(double total, backend_->TakeSumSquares());
  EXPECT_EQ(total, expected);
  EXPECT_NEAR(total, static_cast<double>(reference),
              1e-12 * static_cast<double>(reference));
  ASSERT_OK_AND_ASSIGN(double again, backend_->TakeSumSquares());
  EXPECT_EQ(again, 0.0);  // taken: it starts over
  EXPECT_THAT(backend_->EnqueueSumSquares(n + 1, scratch.data()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("EnqueueSumSquares: x")));
}

// SumSquaresMany's one wait reads the queued sums too (a step's gradient
// sums carry the last step's update sizes): the queue's total is the same
// bits, a TakeSumSquares after it does not wait, sums queued after it
// wait again; host_waits counts each wait once.
TEST_P(BackendConformanceTest, SumSquaresManyReadsTheQueuedSumsInItsWait) {
  const int64_t n = 301;
  const std::vector<float> host = RandomNormal(n * 3, 7500, 0.0f, 1.5f);
  DeviceBuffer values = Upload(host);
  const float* x[3] = {values.data(), values.data() + n, values.data() + 2 * n};
  double expected = 0;
  for (int k = 0; k < 3; ++k) {
    ASSERT_OK_AND_ASSIGN(double one, backend_->SumSquares(n, x[k]));
    expected += one;
  }
  const int64_t start = backend_->host_waits();
  for (int k = 0; k < 3; ++k) {
    ASSERT_OK(backend_->EnqueueSumSquares(n, x[k]));
  }
  EXPECT_EQ(backend_->host_waits(), start);
  std::vector<const float*> xs = {x[2]};
  std::vector<int64_t> ns = {n};
  std::vector<double> many(1);
  ASSERT_OK(backend_->SumSquaresMany(xs, ns, absl::MakeSpan(many)));
  EXPECT_EQ(backend_->host_waits(), start + 1);
  ASSERT_OK_AND_ASSIGN(double total, backend_->TakeSumSquares());
  EXPECT_EQ(total, expected);
  EXPECT_EQ(backend_->host_waits(), start + 1) << "read by SumSquaresMany";
  ASSERT_OK(backend_->EnqueueSumSquares(n, x[0]));
  ASSERT_OK(backend_->SumSquaresMany(xs, ns, absl::MakeSpan(many)));
  ASSERT_OK(backend_->EnqueueSumSquares(n, x[1]));
  ASSERT_OK_AND_ASSIGN(double two, backend_->TakeSumSquares());
  EXPECT_EQ(backend_->host_waits(), start + 3) << "one queued after it";
  ASSERT_OK_AND_ASSIGN(double a, backend_->SumSquares(n, x[0]));
  ASSERT_OK_AND_ASSIGN(double b, backend_->SumSquares(n, x[1]));
  EXPECT_EQ(two, a + b);
  ASSERT_OK(backend_->Synchronize());
  EXPECT_EQ(backend_->host_waits(), start + 6);
}

// An update's size in one read: the queued sum of (a - b)^2 is the bits
// Axpby then EnqueueSumSquares give (the arrays aligned alike), for sizes
// around the vector width, near-equal values (cancellation) included; a
// float64 reference agrees; ranges are checked.
TEST_P(BackendConformanceTest, SquaredDistanceIsTheDifferencesSumSquares) {
  for (int64_t n :
       {int64_t{1}, int64_t{3}, int64_t{4}, int64_t{1001}, int64_t{1} << 20}) {
    SCOPED_TRACE(n);
    const std::vector<float> a = RandomNormal(n, 7700 + n, 0.0f, 1.0f);
    std::vector<float> b = RandomNormal(n, 7800 + n, 0.0f, 1.0f);
    for (int64_t i = 0; i < n; i += 3) b[i] = a[i] * (1 + 1e-6f);
    DeviceBuffer da = Upload(a), db = Upload(b), diff = Upload(b);
    ASSERT_OK(backend_->Axpby(n, 1.0f, da.data(), -1.0f, diff.data()));
    ASSERT_OK(backend_->EnqueueSumSquares(n, diff.data()));
    ASSERT_OK_AND_ASSIGN(double two_passes, backend_->TakeSumSquares());
    ASSERT_OK(backend_->EnqueueSquaredDistance(n, da.data(), db.data()));
    ASSERT_OK_AND_ASSIGN(double fused, backend_->TakeSumSquares());
    EXPECT_EQ(fused, two_passes);
    long double reference = 0;
    for (int64_t i = 0; i < n; ++i) {
      const long double d = static_cast<float>(a[i] - b[i]);
      reference += d * d;
    }
    EXPECT_NEAR(fused, static_cast<double>(reference),
                1e-12 * static_cast<double>(reference));
    // b written right after it is queued: the sum read the old bytes.
    ASSERT_OK(backend_->EnqueueSquaredDistance(n, da.data(), db.data()));
    ASSERT_OK(backend_->Fill(0.0f, n, db.data()));
    ASSERT_OK_AND_ASSIGN(double queued, backend_->TakeSumSquares());
    EXPECT_EQ(queued, fused);
  }
  DeviceBuffer x = Zeros(8);
  EXPECT_THAT(backend_->EnqueueSquaredDistance(9, x.data(), x.data()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("EnqueueSquaredDistance: a")));
  EXPECT_THAT(backend_->EnqueueSquaredDistance(4, x.data(), nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("EnqueueSquaredDistance")));
}

// An update that counts its change (SquaredChange::kQueue) writes the same
// bits as without, and queues the sum of squares EnqueueSquaredDistance
// gives on its new and old values (the arrays aligned alike): Axpby's y
// and AdamWStep's p, for sizes around the vector width.
TEST_P(BackendConformanceTest, UpdatesQueueTheirChangeInTheirPass) {
  for (int64_t n : {int64_t{1}, int64_t{5}, int64_t{1003}, int64_t{1} << 18}) {
    SCOPED_TRACE(n);
    const std::vector<float> x = RandomNormal(n, 7900 + n, 0.0f, 1.0f);
    const std::vector<float> y = RandomNormal(n, 8000 + n, 0.0f, 1.0f);
    DeviceBuffer dx = Upload(x), old = Upload(y);
    DeviceBuffer plain = Upload(y), counted = Upload(y);
    ASSERT_OK(backend_->Axpby(n, -0.02f, dx.data(), 0.999f, plain.data()));
    ASSERT_OK(backend_->Axpby(n, -0.02f, dx.data(), 0.999f, counted.data(),
                              SquaredChange::kQueue));
    ASSERT_OK_AND_ASSIGN(double in_pass, backend_->TakeSumSquares());
    EXPECT_EQ(Download(counted), Download(plain));
    ASSERT_OK(backend_->EnqueueSquaredDistance(n, plain.data(), old.data()));
    ASSERT_OK_AND_ASSIGN(double distance, backend_->TakeSumSquares());
    EXPECT_EQ(in_pass, distance);
    EXPECT_GT(in_pass, 0.0);

    const std::vector<float> m0 = RandomNormal(n, 8100 + n, 0.0f, 0.1f);
    std::vector<float> v0 = RandomNormal(n, 8200 + n, 0.0f, 0.01f);
    for (float& v : v0) v = v * v;
    DeviceBuffer p1 = Upload(y), m1 = Upload(m0), v1 = Upload(v0);
    DeviceBuffer p2 = Upload(y), m2 = Upload(m0), v2 = Upload(v0);
    ASSERT_OK(backend_->AdamWStep(n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 3,
                                  dx.data(), p1.data(), m1.data(), v1.data()));
    ASSERT_OK(backend_->AdamWStep(n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 3,
                                  dx.data(), p2.data(), m2.data(), v2.data(),
                                  SquaredChange::kQueue));
    ASSERT_OK_AND_ASSIGN(double adamw, backend_->TakeSumSquares());
    EXPECT_EQ(Download(p2), Download(p1));
    EXPECT_EQ(Download(m2), Download(m1));
    EXPECT_EQ(Download(v2), Download(v1));
    ASSERT_OK(backend_->EnqueueSquaredDistance(n, p1.data(), old.data()));
    ASSERT_OK_AND_ASSIGN(double adamw_distance, backend_->TakeSumSquares());
    EXPECT_EQ(adamw, adamw_distance);
  }
}

// Device time: marks around work, read once it is done (a GPU's events);
// bad or unset marks are errors naming the mark.
TEST_P(BackendConformanceTest, MarksTimeTheWorkBetweenThem) {
  EXPECT_THAT(backend_->SecondsBetween(0, 1),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("was never set")));
  const int64_t n = 512;
  const std::vector<float> host = RandomNormal(n * n, 7600, 0.0f, 1.0f);
  DeviceBuffer a = Upload(host);
  DeviceBuffer c = Zeros(n * n);
  ASSERT_OK(backend_->Mark(0));
  for (int k = 0; k < 4; ++k) {
    ASSERT_OK(backend_->Gemm(Transpose::kNo, Transpose::kNo, n, n, n, 1.0f,
                             a.data(), n, a.data(), n, 0.0f, c.data(), n));
  }
  ASSERT_OK(backend_->Mark(1));
  ASSERT_OK(backend_->Synchronize());
  ASSERT_OK_AND_ASSIGN(double seconds, backend_->SecondsBetween(0, 1));
  EXPECT_GT(seconds, 0.0);
  EXPECT_LT(seconds, 60.0);
  ASSERT_OK_AND_ASSIGN(double none, backend_->SecondsBetween(1, 1));
  EXPECT_EQ(none, 0.0);
  EXPECT_THAT(
      backend_->Mark(Backend::kTimeMarks),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("Mark: mark 4")));
  EXPECT_THAT(backend_->SecondsBetween(-1, 0),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("SecondsBetween: mark -1")));
}

// Asking for the time while the device still runs the work (a step whose
// answer did not wait for it) is UNAVAILABLE or a time, and leaves later
// calls working: on cuda the query's cudaErrorNotReady must not become the
// next kernel launch's error.
TEST_P(BackendConformanceTest, MarksAskedEarlyLeaveLaterCallsWorking) {
  const int64_t n = backend_->kind() == BackendKind::kCuda ? 2048 : 64;
  const std::vector<float> host = RandomNormal(n * n, 7610, 0.0f, 1.0f);
  DeviceBuffer a = Upload(host);
  DeviceBuffer c = Zeros(n * n);
  ASSERT_OK(backend_->Mark(0));
  for (int k = 0; k < 8; ++k) {
    ASSERT_OK(backend_->Gemm(Transpose::kNo, Transpose::kNo, n, n, n, 1.0f,
                             a.data(), n, a.data(), n, 0.0f, c.data(), n));
  }
  ASSERT_OK(backend_->Mark(1));
  const absl::StatusOr<double> early = backend_->SecondsBetween(0, 1);
  if (!early.ok()) {
    EXPECT_THAT(early, StatusIs(absl::StatusCode::kUnavailable,
                                HasSubstr("is running")));
  }
  ASSERT_OK(backend_->Scale(n * n, 0.5f, c.data()));
  ASSERT_OK_AND_ASSIGN(double sum, backend_->SumSquares(n * n, a.data()));
  EXPECT_GT(sum, 0.0);
  ASSERT_OK(backend_->Synchronize());
  ASSERT_OK_AND_ASSIGN(double seconds, backend_->SecondsBetween(0, 1));
  EXPECT_GT(seconds, 0.0);
}

TEST_P(BackendConformanceTest, AllFiniteDetectsNanAndInfAnywhere) {
  for (int64_t n : {int64_t{1003}, (int64_t{1} << 20) + 3}) {
    const std::vector<float> x = RandomNormal(n, 7100, 0.0f, 1e30f);
    DeviceBuffer dx = Upload(x);
    ASSERT_OK_AND_ASSIGN(bool finite, backend_->AllFinite(n, dx.data()));
    EXPECT_TRUE(finite) << n;
    for (float bad : {std::numeric_limits<float>::quiet_NaN(),
                      std::numeric_limits<float>::infinity(),
                      -std::numeric_limits<float>::infinity()}) {
      for (int64_t pos : {int64_t{0}, int64_t{500}, n / 2, n - 1}) {
        std::vector<float> y = x;
        y[pos] = bad;
        DeviceBuffer dy = Upload(y);
        ASSERT_OK_AND_ASSIGN(bool ok, backend_->AllFinite(n, dy.data()));
        EXPECT_FALSE(ok) << bad << " at " << pos << " of " << n;
        // The same array without the bad element (unaligned start).
        if (pos == 0) {
          ASSERT_OK_AND_ASSIGN(ok, backend_->AllFinite(n - 1, dy.data() + 1));
          EXPECT_TRUE(ok) << n;
        }
      }
    }
  }
}

// The step decides "any non-finite gradient?" from the gradient's sum of
// squares (rank_step.cc): that holds only if the double accumulation never
// overflows on finite input, even at the largest floats.
TEST_P(BackendConformanceTest, SumSquaresIsNonFiniteExactlyWhenAnElementIs) {
  const float kMax = std::numeric_limits<float>::max();
  for (int64_t n : {int64_t{1003}, (int64_t{1} << 20) + 3}) {
    std::vector<float> x = RandomNormal(n, 7200, 0.0f, 1e30f);
    for (int64_t i = 0; i < n; i += 97) x[i] = (i % 2 == 0) ? kMax : -kMax;
    DeviceBuffer dx = Upload(x);
    ASSERT_OK_AND_ASSIGN(double sum, backend_->SumSquares(n, dx.data()));
    EXPECT_TRUE(std::isfinite(sum)) << n;
    EXPECT_GT(sum, static_cast<double>(kMax) * kMax) << n;
    for (float bad : {std::numeric_limits<float>::quiet_NaN(),
                      std::numeric_limits<float>::infinity(),
                      -std::numeric_limits<float>::infinity()}) {
      for (int64_t pos : {int64_t{0}, int64_t{500}, n / 2, n - 1}) {
        std::vector<float> y = x;
        y[pos] = bad;
        DeviceBuffer dy = Upload(y);
        ASSERT_OK_AND_ASSIGN(double s, backend_->SumSquares(n, dy.data()));
        EXPECT_FALSE(std::isfinite(s)) << bad << " at " << pos << " of " << n;
      }
    }
  }
}

// ---- Matrix helpers ---------------------------------------------------------

const Shape kMatrixShapes[] = {{1, 7},   {7, 1},    {13, 5},  {5, 13},
                               {31, 31}, {64, 48},  {33, 65}, {64, 64},
                               {37, 53}, {160, 96}, {300, 5}, {129, 130}};

TEST_P(BackendConformanceTest, AddIdentityTouchesOnlyDiagonal) {
  for (int64_t n : {1, 7, 31, 64, 129, 160, 300}) {
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

TEST_P(BackendConformanceTest, ScaleColumnsAndColumnDots) {
  for (const Shape& s : kMatrixShapes) {
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

TEST_P(BackendConformanceTest, ColumnDotsOfZeroRowsAreZeros) {
  DeviceBuffer dout = Upload(RandomNormal(5, 8150));
  ASSERT_OK(backend_->ColumnDots(0, 5, nullptr, nullptr, dout.data()));
  EXPECT_EQ(Download(dout), std::vector<float>(5, 0.0f));
}

// Keys that put a random permutation's entries in descending order:
// keys[perm[j]] = n - j, so a sort by them gathers by perm.
std::vector<float> KeysOrdering(const std::vector<int64_t>& perm) {
  const auto n = static_cast<int64_t>(perm.size());
  std::vector<float> keys(perm.size());
  for (int64_t j = 0; j < n; ++j) keys[perm[j]] = static_cast<float>(n - j);
  return keys;
}

// The sorts' gathers on every matrix shape, by a random order (the sorts'
// own order, ties and NaNs: backend_conformance_device_scalars.cc).
TEST_P(BackendConformanceTest, SortColumnsAndRowsGatherOnEveryShape) {
  for (const Shape& s : kMatrixShapes) {
    SCOPED_TRACE(ShapeName(s.rows, s.cols));
    const std::vector<float> src = RandomNormal(s.rows * s.cols, 8200);
    DeviceBuffer dsrc = Upload(src), ddst = Zeros(s.rows * s.cols);
    const std::vector<int64_t> col_perm = RandomPermutation(s.cols, 8201);
    DeviceBuffer col_keys = Upload(KeysOrdering(col_perm));
    ASSERT_OK(backend_->SortColumns(s.rows, s.cols, col_keys.data(),
                                    dsrc.data(), ddst.data()));
    std::vector<float> out = Download(ddst);
    for (int64_t i = 0; i < s.rows; ++i) {
      for (int64_t j = 0; j < s.cols; ++j) {
        ASSERT_EQ(out[i * s.cols + j], src[i * s.cols + col_perm[j]]);
      }
    }
    const std::vector<int64_t> row_perm = RandomPermutation(s.rows, 8202);
    DeviceBuffer row_keys = Upload(KeysOrdering(row_perm));
    ASSERT_OK(backend_->SortRows(s.rows, s.cols, row_keys.data(), dsrc.data(),
                                 ddst.data()));
    out = Download(ddst);
    for (int64_t i = 0; i < s.rows; ++i) {
      for (int64_t j = 0; j < s.cols; ++j) {
        ASSERT_EQ(out[i * s.cols + j], src[row_perm[i] * s.cols + j]);
      }
    }
  }
}

TEST_P(BackendConformanceTest, Transpose2DAcrossBlockBoundaries) {
  for (const Shape& s : kMatrixShapes) {
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

}  // namespace
}  // namespace canzona
