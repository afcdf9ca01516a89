// Update rules on the fp32 cpu backend against the float64 references of
// reference.h, plus Newton-Schulz's singular-value bands and the state /
// batching / override contracts.
//
// Accuracy is measured on the displacement p_t - p_0 (not on p_t, whose
// norm is dominated by p_0 and would hide errors in the updates), as the
// relative Frobenius error after every step, and the maximum is asserted.
#include "server/optim/update_rule.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/optim/reference.h"
#include "tests/unit/optim/update_rule_test_util.h"

namespace canzona {
namespace {

using ::canzona::optim_test::Config;
using ::canzona::optim_test::CpuBackend;
using ::canzona::optim_test::Harness;
using ::canzona::optim_test::kAdamW;
using ::canzona::optim_test::kMuon;
using ::canzona::optim_test::kShampoo;
using ::canzona::optim_test::kSoap;
using ::canzona::optim_test::Mat;
using ::canzona::optim_test::RandomNormal;
using ::canzona::optim_test::Settings;

std::unique_ptr<optim_test::RefRule> MakeRef(const OptimizerConfig& c,
                                             int64_t rows, int64_t cols) {
  switch (c.kind) {
    case OptimizerKind::kMuon:
      return std::make_unique<optim_test::MuonRef>(c.muon, rows, cols);
    case OptimizerKind::kAdamW:
      return std::make_unique<optim_test::AdamWRef>(c.adamw, rows * cols);
    case OptimizerKind::kShampoo:
      return std::make_unique<optim_test::ShampooRef>(c.shampoo, rows, cols);
    case OptimizerKind::kSoap:
      return std::make_unique<optim_test::SoapRef>(c.soap, rows, cols);
  }
  return nullptr;
}

// Checks that `q` is an orthonormal eigenbasis of `factor` with eigenvalues
// in descending order equal to the reference's.
void ExpectDescendingEigenbasis(const Mat& q, const Mat& factor,
                                const std::string& what) {
  const int64_t n = q.rows;
  const Mat qtq = optim_test::MatMul(optim_test::Transposed(q), q);
  double ortho = 0;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      ortho = std::max(ortho, std::fabs(qtq(i, j) - (i == j ? 1.0 : 0.0)));
    }
  }
  EXPECT_LE(ortho, 1e-5) << what << ": not orthonormal";
  std::vector<double> lam;
  optim_test::DescendingEigenbasis(factor, &lam);
  const Mat d = optim_test::MatMul(optim_test::Transposed(q),
                                   optim_test::MatMul(factor, q));
  const double scale = optim_test::FrobeniusNorm(factor);
  double off = 0, diag = 0;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      if (i == j) {
        diag = std::max(diag, std::fabs(d(i, i) - lam[i]));
      } else {
        off += d(i, j) * d(i, j);
      }
    }
  }
  EXPECT_LE(std::sqrt(off), 1e-5 * scale) << what << ": not an eigenbasis";
  EXPECT_LE(diag, 1e-5 * scale)
      << what << ": eigenvalues differ / not descending";
}

struct Case {
  std::string name;
  OptimizerKind kind;
  Settings settings;
  std::vector<int64_t> shape;
  int steps;
  double tolerance;
};

// gtest prints a failing parameter with this instead of its bytes.
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

// Runs `c` on the cpu backend and on the float64 reference with the same
// data; returns the largest relative error of the displacement.
double RunAgainstReference(const Case& c, uint64_t seed) {
  const OptimizerConfig config = Config(c.kind, c.settings);
  const int64_t numel = NumElements(c.shape);
  const int64_t rows = c.shape.size() == 2 ? c.shape[0] : 1;
  const int64_t cols = c.shape.size() == 2 ? c.shape[1] : numel;
  Harness h;
  h.Init(numel);
  auto rule = UpdateRule::Create(config, c.shape, h.backend.get());
  EXPECT_TRUE(rule.ok()) << rule.status();
  if (!rule.ok()) return INFINITY;
  std::unique_ptr<optim_test::RefRule> ref = MakeRef(config, rows, cols);

  std::mt19937_64 rng(seed);
  const std::vector<float> p0 = RandomNormal(numel, rng, 0.2);
  h.SetParam(p0);
  Mat p = optim_test::FromFloats(rows, cols, p0);
  const Mat p_start = p;
  const double lr = ConfigLearningRate(config);
  double worst = 0;
  for (int step = 0; step < c.steps; ++step) {
    const std::vector<float> g = RandomNormal(numel, rng, 1.0);
    EXPECT_OK(h.Step(**rule, g));
    ref->Step(p, optim_test::FromFloats(rows, cols, g), lr);

    if (c.kind == OptimizerKind::kSoap && step == 0) {
      // SOAP's first call only builds the bases. Where a factor is
      // singular (non-square G: G G^T or G^T G has a null space) the
      // basis of that null space is arbitrary and the rest of the run
      // depends on it, so check that the implementation's bases are
      // descending orthonormal eigenbases of the reference's factors and
      // continue the reference from them. Square shapes keep the
      // reference's own bases: there the run is a function of the data.
      auto* soap = static_cast<optim_test::SoapRef*>(ref.get());
      auto state = (*rule)->SaveState();
      EXPECT_OK(state);
      Mat ql = soap->ql(), qr = soap->qr();
      if (soap->left()) {
        const StateTensor* t = state->FindTensor("QL");
        EXPECT_NE(t, nullptr);
        if (t == nullptr) return INFINITY;
        ql = optim_test::FromFloats(rows, rows, t->data);
        ExpectDescendingEigenbasis(ql, soap->gl(), c.name + " QL");
      }
      if (soap->right()) {
        const StateTensor* t = state->FindTensor("QR");
        EXPECT_NE(t, nullptr);
        if (t == nullptr) return INFINITY;
        qr = optim_test::FromFloats(cols, cols, t->data);
        ExpectDescendingEigenbasis(qr, soap->gr(), c.name + " QR");
      }
      if (rows != cols) soap->SetBases(ql, qr);
    }

    const std::vector<float> got = h.Param();
    double err = 0, norm = 0;
    for (int64_t i = 0; i < numel; ++i) {
      const double want = p.a[i] - p_start.a[i];
      const double have = static_cast<double>(got[i]) - p_start.a[i];
      err += (have - want) * (have - want);
      norm += want * want;
    }
    if (norm == 0) {
      EXPECT_EQ(err, 0) << c.name << " step " << step << ": expected no update";
      continue;
    }
    worst = std::max(worst, std::sqrt(err / norm));
  }
  return worst;
}

class ReferenceTest : public ::testing::TestWithParam<Case> {};

TEST_P(ReferenceTest, MatchesFloat64Reference) {
  const Case& c = GetParam();
  const double worst = RunAgainstReference(
      c, 0x5eed0000 + c.steps * 131 + c.shape.back() * 7919);
  std::printf("[ reference ] %-45s max relative error %.3e\n", c.name.c_str(),
              worst);
  EXPECT_LE(worst, c.tolerance) << c.name;
}

INSTANTIATE_TEST_SUITE_P(
    Muon, ReferenceTest,
    ::testing::Values(
        Case{"square_defaults", kMuon, {}, {16, 16}, 6, 1e-4},
        Case{"tall_quintic_match_rms_weight_decay",
             kMuon,
             {{"ns_coefficients", "quintic"},
              {"scale", "match_rms_adamw"},
              {"weight_decay", "0.1"}},
             {24, 10},
             6,
             1e-4},
        Case{"wide_polar_express_no_nesterov",
             kMuon,
             {{"ns_coefficients", "polar_express"},
              {"nesterov", "false"},
              {"momentum", "0.9"}},
             {10, 27},
             6,
             1e-4},
        Case{"row_vector", kMuon, {}, {1, 37}, 5, 1e-4},
        Case{"quintic_cycles_7_steps",
             kMuon,
             {{"ns_coefficients", "quintic"}, {"ns_steps", "7"}},
             {13, 21},
             5,
             1e-4},
        Case{"polar_express_last_repeated_tall_spectral",
             kMuon,
             {{"ns_coefficients", "polar_express"}, {"ns_steps", "7"}},
             {30, 9},
             5,
             1e-4},
        Case{"fp32_eps_lr",
             kMuon,
             {{"ns_precision", "fp32"}, {"eps", "1e-5"}, {"lr", "0.05"}},
             {9, 9},
             5,
             1e-4},
        // The Gram iteration is the same polynomial: the same float64
        // reference and tolerance, tall and wide, every coefficient set.
        Case{"gram_wide_defaults",
             kMuon,
             {{"ns_algorithm", "gram"}},
             {12, 40},
             6,
             1e-4},
        Case{"gram_tall_quintic",
             kMuon,
             {{"ns_algorithm", "gram"}, {"ns_coefficients", "quintic"}},
             {40, 12},
             5,
             1e-4},
        Case{"gram_polar_express_7_steps",
             kMuon,
             {{"ns_algorithm", "gram"},
              {"ns_coefficients", "polar_express"},
              {"ns_steps", "7"}},
             {17, 31},
             5,
             1e-4},
        Case{"standard_explicit",
             kMuon,
             {{"ns_algorithm", "standard"}},
             {12, 40},
             5,
             1e-4}),
    [](const auto& info) { return info.param.name; });

INSTANTIATE_TEST_SUITE_P(
    AdamW, ReferenceTest,
    ::testing::Values(
        Case{"vector_defaults", kAdamW, {{"lr", "0.02"}}, {37}, 6, 1e-5},
        Case{"matrix_all_options",
             kAdamW,
             {{"lr", "0.02"},
              {"beta1", "0.8"},
              {"beta2", "0.99"},
              {"eps", "1e-6"},
              {"weight_decay", "0.1"}},
             {16, 16},
             6,
             1e-5},
        Case{"three_d", kAdamW, {{"lr", "0.02"}}, {3, 5, 7}, 6, 1e-5},
        Case{"row_vector_no_decay",
             kAdamW,
             {{"lr", "0.02"}, {"weight_decay", "0"}},
             {1, 13},
             6,
             1e-5}),
    [](const auto& info) { return info.param.name; });

// Shampoo's root inverse amplifies the float32 error of a factor's smallest
// eigenvalues by the condition number (F^(-1/4) of an eigenvalue known to
// relative accuracy eps * cond). A single square gradient gives
// cond(G G^T) = cond(G)^2 (10^4 and more for random 16 x 16), so the
// cases start preconditioning only once enough gradients are accumulated
// that each factor is well conditioned (a Wishart factor n x k with k >= 2n
// has cond ~ 10..50): start_preconditioning_step / precondition_frequency
// below are chosen for that, per shape.
INSTANTIATE_TEST_SUITE_P(
    Shampoo, ReferenceTest,
    ::testing::Values(
        // Defaults (adam grafting, beta2 = 1, f = 1) but preconditioning from
        // step 4: steps 1-3 are the grafting-only path.
        Case{"square_defaults_start_4",
             kShampoo,
             {{"start_preconditioning_step", "4"}},
             {16, 16},
             7,
             1e-4},
        // Default start (= frequency = 3).
        Case{"square_frequency_3",
             kShampoo,
             {{"precondition_frequency", "3"}},
             {12, 12},
             7,
             1e-4},
        Case{"tall_frequency_4_beta2_adagrad_weight_decay",
             kShampoo,
             {{"precondition_frequency", "4"},
              {"beta2", "0.99"},
              {"grafting", "adagrad"},
              {"weight_decay", "0.01"}},
             {24, 10},
             9,
             1e-4},
        // Blocks 8/8/4 x 8/5, each with its own factors and no grafting.
        Case{"blocked_no_grafting",
             kShampoo,
             {{"max_preconditioner_dim", "8"},
              {"grafting", "none"},
              {"precondition_frequency", "2"},
              {"start_preconditioning_step", "4"}},
             {20, 13},
             7,
             1e-4},
        Case{"blocked_adam_grafting_wide",
             kShampoo,
             {{"max_preconditioner_dim", "16"},
              {"precondition_frequency", "2"},
              {"start_preconditioning_step", "6"}},
             {9, 40},
             8,
             1e-4},
        Case{"wide_frequency_2_start_8",
             kShampoo,
             {{"precondition_frequency", "2"},
              {"start_preconditioning_step", "8"},
              {"beta2", "0.999"},
              {"weight_decay", "0.05"},
              {"grafting_beta2", "0.99"},
              {"grafting_epsilon", "1e-6"}},
             {7, 30},
             11,
             1e-4},
        // 1 x 37: R = sum g^T g has rank t < 37, so with epsilon = 1e-12 its
        // null-space eigenvalues would be float32 noise raised to -1/4.
        // epsilon = 1e-2 (R's nonzero eigenvalues are ~37) makes the root
        // inverse well defined; beta1 = 0 tests the no-momentum path, where
        // Gh = G lies in R's range exactly.
        Case{"row_vector_beta1_0_epsilon_1e-2",
             kShampoo,
             {{"beta1", "0"}, {"epsilon", "1e-2"}},
             {1, 37},
             6,
             1e-4}),
    [](const auto& info) {
      std::string name = info.param.name;
      std::replace(name.begin(), name.end(), '-', '_');
      return name;
    });

// SOAP: for non-square shapes the first-call bases are seeded into the
// reference (see RunAgainstReference), and the refresh frequency is chosen
// so that (f + 1) * min(m, n) >= 2 max(m, n) gradients are in each factor
// at its first QR refresh: qr(GX Q) is then well conditioned, so the
// refreshed basis is a well-defined function of the data.
INSTANTIATE_TEST_SUITE_P(
    Soap, ReferenceTest,
    ::testing::Values(
        Case{"square_defaults_refresh_at_10", kSoap, {}, {16, 16}, 13, 1e-4},
        Case{"square_frequency_3_normalize_no_bias_correction",
             kSoap,
             {{"precondition_frequency", "3"},
              {"normalize_grads", "true"},
              {"correct_bias", "false"}},
             {12, 12},
             9,
             1e-4},
        Case{"tall_both_sides_frequency_3",
             kSoap,
             {{"precondition_frequency", "3"},
              {"shampoo_beta", "0.9"},
              {"weight_decay", "0"},
              {"lr", "0.01"}},
             {20, 12},
             9,
             1e-4},
        Case{"wide_both_sides_frequency_5",
             kSoap,
             {{"precondition_frequency", "5"},
              {"beta1", "0.9"},
              {"beta2", "0.99"},
              {"lr", "0.01"}},
             {9, 26},
             12,
             1e-4},
        Case{"identity_right_side",
             kSoap,
             {{"max_precond_dim", "20"}, {"precondition_frequency", "3"}},
             {12, 40},
             9,
             1e-4},
        Case{"identity_left_side",
             kSoap,
             {{"max_precond_dim", "20"}, {"precondition_frequency", "2"}},
             {40, 12},
             7,
             1e-4},
        Case{"both_sides_identity",
             kSoap,
             {{"max_precond_dim", "8"}},
             {11, 10},
             5,
             1e-4},
        Case{"row_vector_frequency_30",
             kSoap,
             {{"precondition_frequency", "30"}},
             {1, 13},
             34,
             1e-4}),
    [](const auto& info) { return info.param.name; });

// ---- Newton-Schulz singular-value bands ------------------------------------

TEST(NewtonSchulzBandTest, SingularValuesInTheCoefficientSetsBand) {
  std::unique_ptr<Backend> backend = CpuBackend();
  ASSERT_NE(backend, nullptr);
  const int64_t rows = 24, cols = 40;  // aspect 0.6: sigma_min/sigma_max ~ 0.1
  std::mt19937_64 rng(77);
  const std::vector<float> input = RandomNormal(rows * cols, rng, 1.0);
  const Mat x = optim_test::FromFloats(rows, cols, input);
  const std::vector<double> sigma_in = optim_test::SingularValues(x);
  const double frob = optim_test::FrobeniusNorm(x);

  for (const auto& [set, algorithm] :
       std::vector<std::pair<NsCoefficients, NsAlgorithm>>{
           {NsCoefficients::kSimple, NsAlgorithm::kStandard},
           {NsCoefficients::kQuintic, NsAlgorithm::kStandard},
           {NsCoefficients::kPolarExpress, NsAlgorithm::kStandard},
           {NsCoefficients::kSimple, NsAlgorithm::kGram},
           {NsCoefficients::kQuintic, NsAlgorithm::kGram},
           {NsCoefficients::kPolarExpress, NsAlgorithm::kGram}}) {
    SCOPED_TRACE(NsAlgorithmName(algorithm));
    MuonOptions options;
    options.ns_coefficients = set;
    options.ns_algorithm = algorithm;
    ASSERT_OK_AND_ASSIGN(NewtonSchulzSpec spec,
                         NewtonSchulzSpecFor(options, BackendKind::kCpu));
    ASSERT_EQ(spec.coefficients.size(), 5u);
    // The scalar iteration on the normalized singular values: each output
    // singular value is |p^5(sigma / (scale ||X||_F + eps))|.
    const auto coeffs = optim_test::Coefficients(set, 5);
    const double lo =
        sigma_in.back() / (spec.norm_scale * frob + spec.norm_eps);
    double band_min = INFINITY, band_max = 0;
    constexpr int kGrid = 200000;
    for (int i = 0; i <= kGrid; ++i) {
      double s = lo + (1.0 - lo) * i / kGrid;
      for (const auto& [a, b, c] : coeffs)
        s = a * s + b * s * s * s + c * s * s * s * s * s;
      band_min = std::min(band_min, std::fabs(s));
      band_max = std::max(band_max, std::fabs(s));
    }
    // The bands are narrow enough to mean something.
    EXPECT_GT(band_min, 0.5) << NsCoefficientsName(set);
    EXPECT_LT(band_max, 1.35) << NsCoefficientsName(set);

    ASSERT_OK_AND_ASSIGN(DeviceBuffer buf, backend->Allocate(rows * cols));
    ASSERT_OK(backend->CopyFromHost(input.data(), rows * cols, buf.data()));
    ASSERT_OK(
        backend->NewtonSchulz(spec, 1, rows, cols, buf.data(), buf.data()));
    std::vector<float> out(rows * cols);
    ASSERT_OK(backend->CopyToHost(buf.data(), rows * cols, out.data()));
    const std::vector<double> sigma =
        optim_test::SingularValues(optim_test::FromFloats(rows, cols, out));
    // 1e-4: float32 rounding of five iterations (observed ~1e-6); the grid
    // step is 5e-6 in the input.
    constexpr double kSlack = 1e-4;
    std::printf(
        "[ ns band   ] %-14s %-8s band [%.4f, %.4f] output [%.4f, %.4f]\n",
        std::string(NsCoefficientsName(set)).c_str(),
        NsAlgorithmName(algorithm), band_min, band_max, sigma.back(),
        sigma.front());
    EXPECT_GE(sigma.back(), band_min - kSlack) << NsCoefficientsName(set);
    EXPECT_LE(sigma.front(), band_max + kSlack) << NsCoefficientsName(set);
  }
}

// ---- Creation and configuration contracts -----------------------------------
}  // namespace
}  // namespace canzona
