// Conformance: Newton-Schulz's algorithms (kernels/ns_algorithm.h). The
// Gram iteration computes the standard iteration's polynomial through
// R = X X^T, which squares X's conditioning; so every algorithm must match
// the float64 standard iteration within the backend's Newton-Schulz
// tolerance, and its result's singular values must be the coefficient
// set's polynomial of the input's, inside the set's band, on random, tall,
// wide, square, ill-conditioned (4 decades), low-rank and tiny-norm inputs,
// for each coefficient set.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/ns_algorithm.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/kernels/backend_conformance.h"
#include "tests/unit/kernels/backend_reference.h"

namespace canzona {
namespace {

using ::canzona::backend_reference::Matrix;
using ::canzona::backend_reference::NewtonSchulzReference;
using ::canzona::backend_reference::RandomNormal;
using ::canzona::backend_reference::RelativeError;
using ::canzona::backend_reference::ShapeName;
using ::canzona::backend_reference::SingularValues;
using ::canzona::backend_reference::ToDouble;

// Muon's coefficient sets as server/optim resolves them (5 steps each; the
// kernels do not depend on server/optim, so they are spelled out here).
struct CoefficientSet {
  std::string name;
  NewtonSchulzSpec spec;
};

std::vector<CoefficientSet> CoefficientSets() {
  std::vector<CoefficientSet> sets(3);
  sets[0].name = "simple";
  sets[0].spec.coefficients.assign(5, {3.4445f, -4.7750f, 2.0315f});
  sets[1].name = "quintic";
  sets[1].spec.coefficients = {{4.0848f, -6.8946f, 2.9270f},
                               {3.9505f, -6.3029f, 2.6377f},
                               {3.7418f, -5.5913f, 2.3037f},
                               {2.8769f, -3.1427f, 1.2046f},
                               {2.8366f, -3.0525f, 1.2012f}};
  sets[2].name = "polar_express";
  sets[2].spec.coefficients = {
      {8.156554524902461f, -22.48329292557795f, 15.878769915207462f},
      {4.042929935166739f, -2.808917465908714f, 0.5000178451051316f},
      {3.8916678022926607f, -2.772484153217685f, 0.5060648178503393f},
      {3.285753657755655f, -2.3681294933425376f, 0.46449024233003106f},
      {2.3465413258596377f, -1.7097828382687081f, 0.42323551169305323f}};
  sets[2].spec.norm_scale = 1.02f;
  sets[2].spec.norm_eps = 1e-6f;
  return sets;
}

// The scalar image of one singular value t of the normalized input.
double Polynomial(const NewtonSchulzSpec& spec, double t) {
  for (const auto& [a, b, c] : spec.coefficients) {
    const double t2 = t * t;
    t = a * t + b * t * t2 + c * t * t2 * t2;
  }
  return t;
}

// The set's band: the largest value the polynomial takes on [0, 1] (the
// normalization puts every singular value there).
double BandTop(const NewtonSchulzSpec& spec) {
  double top = 0.0;
  for (int i = 0; i <= 20000; ++i)
    top = std::max(top, Polynomial(spec, i / 2e4));
  return top;
}

// X = U diag(sigma) V^T with sigma log-spaced from 1 down to 10^-decades
// and U, V products of random Householder reflections (exactly orthogonal
// in double, so the singular values are sigma up to float rounding).
std::vector<float> WithSpectrum(int64_t rows, int64_t cols, double decades,
                                uint32_t seed) {
  const int64_t k = std::min(rows, cols);
  Matrix x(static_cast<size_t>(rows * cols), 0.0);
  for (int64_t i = 0; i < k; ++i) {
    x[i * cols + i] =
        std::pow(10.0, -decades * static_cast<double>(i) /
                           static_cast<double>(std::max<int64_t>(1, k - 1)));
  }
  std::mt19937 gen(seed);
  std::normal_distribution<double> normal;
  for (int r = 0; r < 3; ++r) {
    std::vector<double> u(static_cast<size_t>(rows)),
        v(static_cast<size_t>(cols));
    for (double& e : u) e = normal(gen);
    for (double& e : v) e = normal(gen);
    double uu = 0, vv = 0;
    for (double e : u) uu += e * e;
    for (double e : v) vv += e * e;
    // x <- (I - 2 u u^T / u^T u) x (I - 2 v v^T / v^T v)
    for (int64_t j = 0; j < cols; ++j) {
      double dot = 0;
      for (int64_t i = 0; i < rows; ++i) dot += u[i] * x[i * cols + j];
      for (int64_t i = 0; i < rows; ++i) x[i * cols + j] -= 2 * dot / uu * u[i];
    }
    for (int64_t i = 0; i < rows; ++i) {
      double dot = 0;
      for (int64_t j = 0; j < cols; ++j) dot += x[i * cols + j] * v[j];
      for (int64_t j = 0; j < cols; ++j) x[i * cols + j] -= 2 * dot / vv * v[j];
    }
  }
  std::vector<float> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = static_cast<float>(x[i]);
  return out;
}

std::vector<float> LowRank(int64_t rows, int64_t cols, int64_t rank,
                           uint32_t seed) {
  const std::vector<float> a = RandomNormal(rows * rank, seed);
  const std::vector<float> b = RandomNormal(rank * cols, seed + 1);
  std::vector<float> x(static_cast<size_t>(rows * cols));
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      double sum = 0;
      for (int64_t p = 0; p < rank; ++p) {
        sum += double{a[i * rank + p]} * b[p * cols + j];
      }
      x[i * cols + j] = static_cast<float>(sum);
    }
  }
  return x;
}

struct Input {
  std::string name;
  int64_t rows, cols;
  std::vector<float> data;
};

std::vector<Input> Inputs() {
  std::vector<Input> inputs;
  auto add = [&](std::string name, int64_t r, int64_t c, std::vector<float> d) {
    inputs.push_back({std::move(name), r, c, std::move(d)});
  };
  add("random_wide", 40, 96, RandomNormal(40 * 96, 3100));
  add("random_tall", 96, 40, RandomNormal(96 * 40, 3110));
  add("random_square", 48, 48, RandomNormal(48 * 48, 3120));
  add("random_odd", 13, 37, RandomNormal(13 * 37, 3130));
  add("ill_conditioned_wide", 32, 80, WithSpectrum(32, 80, 4.0, 3140));
  add("ill_conditioned_tall", 80, 32, WithSpectrum(80, 32, 4.0, 3150));
  add("ill_conditioned_square", 40, 40, WithSpectrum(40, 40, 4.0, 3160));
  add("low_rank_3", 40, 96, LowRank(40, 96, 3, 3170));
  add("low_rank_tall", 96, 40, LowRank(96, 40, 5, 3180));
  std::vector<float> tiny = RandomNormal(40 * 96, 3190);
  for (float& e : tiny) e *= 1e-9f;  // ||X||_F ~ 6e-8, below norm_eps
  add("tiny_norm", 40, 96, std::move(tiny));
  return inputs;
}

absl::StatusOr<std::vector<float>> RunNs(Backend& backend,
                                         const NewtonSchulzSpec& spec,
                                         int64_t batch, int64_t rows,
                                         int64_t cols,
                                         const std::vector<float>& x) {
  absl::StatusOr<DeviceBuffer> buffer = backend.Allocate(batch * rows * cols);
  if (!buffer.ok()) return buffer.status();
  absl::Status status =
      backend.CopyFromHost(x.data(), batch * rows * cols, buffer->data());
  if (status.ok()) {
    status = backend.NewtonSchulz(spec, batch, rows, cols, buffer->data(),
                                  buffer->data());
  }
  std::vector<float> out(x.size());
  if (status.ok()) {
    status =
        backend.CopyToHost(buffer->data(), batch * rows * cols, out.data());
  }
  if (!status.ok()) return status;
  return out;
}

// Every algorithm, every coefficient set, every input: close to the float64
// standard iteration, and singular values where the polynomial puts them.
TEST_P(BackendConformanceTest, NewtonSchulzAlgorithmsMatchFloat64Standard) {
  const double tol = tolerances().newton_schulz;
  // Singular values: the float32 input's rounding (~1e-7 of ||X||) is
  // amplified by the polynomial's slope near 0 (the product of the a's,
  // under 1000 for every set), so allow 10x the Frobenius tolerance.
  const double sv_tol = 10 * tol;
  for (const CoefficientSet& set : CoefficientSets()) {
    const double band_top = BandTop(set.spec);
    for (const Input& input : Inputs()) {
      const Matrix want =
          NewtonSchulzReference(set.spec, input.data, input.rows, input.cols);
      // The normalized input's singular values, mapped by the polynomial.
      const double norm = std::sqrt(std::inner_product(
          input.data.begin(), input.data.end(), input.data.begin(), 0.0));
      const double denom = set.spec.norm_scale * norm + set.spec.norm_eps;
      std::vector<double> mapped =
          SingularValues(ToDouble(input.data), input.rows, input.cols);
      for (double& s : mapped) s = std::abs(Polynomial(set.spec, s / denom));
      std::sort(mapped.rbegin(), mapped.rend());
      for (NsAlgorithm algorithm :
           {NsAlgorithm::kStandard, NsAlgorithm::kGram, NsAlgorithm::kAuto}) {
        SCOPED_TRACE(absl::StrCat(set.name, " ", input.name, " ",
                                  ShapeName(input.rows, input.cols), " ",
                                  NsAlgorithmName(algorithm)));
        NewtonSchulzSpec spec = set.spec;
        spec.algorithm = algorithm;
        ASSERT_OK_AND_ASSIGN(
            std::vector<float> got,
            RunNs(*backend_, spec, 1, input.rows, input.cols, input.data));
        EXPECT_LE(RelativeError(got, want), tol);
        const std::vector<double> sv =
            SingularValues(ToDouble(got), input.rows, input.cols);
        ASSERT_EQ(sv.size(), mapped.size());
        for (size_t i = 0; i < sv.size(); ++i) {
          EXPECT_NEAR(sv[i], mapped[i], sv_tol) << "singular value " << i;
          EXPECT_LE(sv[i], band_top + sv_tol) << "singular value " << i;
        }
      }
    }
  }
}

// Batched Gram equals per-matrix Gram (per-matrix norms, one strided
// product per step on cuda), tall and wide.
TEST_P(BackendConformanceTest, GramNewtonSchulzBatchedEqualsSingle) {
  NewtonSchulzSpec spec = CoefficientSets()[1].spec;
  spec.algorithm = NsAlgorithm::kGram;
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{24, 56},
                                   std::pair<int64_t, int64_t>{56, 24}}) {
    SCOPED_TRACE(ShapeName(rows, cols));
    const int64_t per = rows * cols, batch = 3;
    std::vector<float> x;
    for (int64_t i = 0; i < batch; ++i) {
      std::vector<float> m = RandomNormal(per, 3200 + i, 0.0f, 1.0f + 5.0f * i);
      x.insert(x.end(), m.begin(), m.end());
    }
    ASSERT_OK_AND_ASSIGN(std::vector<float> batched,
                         RunNs(*backend_, spec, batch, rows, cols, x));
    for (int64_t i = 0; i < batch; ++i) {
      const std::vector<float> one(x.begin() + i * per,
                                   x.begin() + (i + 1) * per);
      ASSERT_OK_AND_ASSIGN(std::vector<float> single,
                           RunNs(*backend_, spec, 1, rows, cols, one));
      const std::vector<float> got(batched.begin() + i * per,
                                   batched.begin() + (i + 1) * per);
      EXPECT_LE(RelativeError(got, ToDouble(single)),
                tolerances().newton_schulz)
          << "matrix " << i;
      EXPECT_LE(
          RelativeError(got, NewtonSchulzReference(spec, one, rows, cols)),
          tolerances().newton_schulz)
          << "matrix " << i;
    }
  }
}

// No steps: Gram is the normalization alone, like the standard iteration.
TEST_P(BackendConformanceTest, GramNewtonSchulzWithoutStepsNormalizes) {
  NewtonSchulzSpec spec;
  spec.algorithm = NsAlgorithm::kGram;
  spec.norm_scale = 2.0f;
  const std::vector<float> x = RandomNormal(17 * 29, 3300);
  ASSERT_OK_AND_ASSIGN(std::vector<float> got,
                       RunNs(*backend_, spec, 1, 17, 29, x));
  EXPECT_LE(RelativeError(got, NewtonSchulzReference(spec, x, 17, 29)),
            tolerances().newton_schulz);
}

// bf16 (where the backend has it): Gram keeps R and Q float32, so it is no
// worse than twice the standard bf16 iteration's own error.
TEST_P(BackendConformanceTest, GramNewtonSchulzBfloat16NearStandard) {
  for (const CoefficientSet& set : CoefficientSets()) {
    for (const Input& input : Inputs()) {
      SCOPED_TRACE(absl::StrCat(set.name, " ", input.name));
      NewtonSchulzSpec spec = set.spec;
      spec.precision = NsPrecision::kBfloat16;
      absl::StatusOr<std::vector<float>> standard =
          RunNs(*backend_, spec, 1, input.rows, input.cols, input.data);
      if (absl::IsUnimplemented(standard.status())) {
        GTEST_SKIP() << "no bf16 Newton-Schulz on " << GetParam().name;
      }
      ASSERT_OK(standard.status());
      spec.algorithm = NsAlgorithm::kGram;
      ASSERT_OK_AND_ASSIGN(
          std::vector<float> gram,
          RunNs(*backend_, spec, 1, input.rows, input.cols, input.data));
      const Matrix want =
          NewtonSchulzReference(set.spec, input.data, input.rows, input.cols);
      EXPECT_LE(RelativeError(gram, want),
                2 * RelativeError(*standard, want) + 1e-3);
    }
  }
}

TEST_P(BackendConformanceTest, NewtonSchulzRejectsUnknownAlgorithm) {
  NewtonSchulzSpec spec = CoefficientSets()[0].spec;
  spec.algorithm = static_cast<NsAlgorithm>(7);
  DeviceBuffer x = Upload(RandomNormal(4 * 6, 3400));
  EXPECT_THAT(backend_->NewtonSchulz(spec, 1, 4, 6, x.data(), x.data()),
              ::canzona::testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                           ::testing::HasSubstr("algorithm")));
  EXPECT_THAT(backend_->ReserveNewtonSchulz(spec, 1, 4, 6),
              ::canzona::testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                           ::testing::HasSubstr("algorithm")));
}

}  // namespace
}  // namespace canzona
