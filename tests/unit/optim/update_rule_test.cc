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
#include <functional>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/optim/forwarding_backend.h"
#include "tests/unit/optim/reference.h"

namespace canzona {
namespace {

using ::canzona::optim_test::Mat;
using ::canzona::testing::IsOk;
using ::canzona::testing::StatusIs;
using ::testing::HasSubstr;
using Settings = std::vector<std::pair<std::string, std::string>>;

// Normal values, never zero (a zero would make sign-like Adam steps and
// relative errors degenerate).
std::vector<float> RandomNormal(int64_t n, std::mt19937_64& rng,
                                double stddev) {
  std::normal_distribution<double> dist(0.0, stddev);
  std::vector<float> out(n);
  for (float& x : out) {
    do {
      x = static_cast<float>(dist(rng));
    } while (std::fabs(x) < 1e-6 * stddev);
  }
  return out;
}

std::unique_ptr<Backend> CpuBackend() {
  auto backend = CreateCpuBackend();
  EXPECT_TRUE(backend.ok()) << backend.status();
  return backend.ok() ? std::move(backend).value() : nullptr;
}

OptimizerConfig Config(OptimizerKind kind, const Settings& settings) {
  auto config = MakeOptimizerConfig(kind, settings);
  EXPECT_TRUE(config.ok()) << config.status();
  return *config;
}

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

// Parameter, gradient and a rule on the cpu backend.
struct Harness {
  std::unique_ptr<Backend> backend = CpuBackend();
  DeviceBuffer param, grad;
  int64_t numel = 0;

  void Init(int64_t n) {
    numel = n;
    param = *backend->Allocate(n);
    grad = *backend->Allocate(n);
  }
  void SetParam(const std::vector<float>& p) {
    ASSERT_OK(backend->CopyFromHost(p.data(), numel, param.data()));
  }
  std::vector<float> Param() {
    std::vector<float> p(numel);
    EXPECT_OK(backend->CopyToHost(param.data(), numel, p.data()));
    return p;
  }
  absl::Status Step(UpdateRule& rule, const std::vector<float>& g,
                    const StepOptions& options = {}) {
    absl::Status s = backend->CopyFromHost(g.data(), numel, grad.data());
    if (!s.ok()) return s;
    return rule.Step(param.data(), grad.data(), options);
  }
};

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

const auto kMuon = OptimizerKind::kMuon;
const auto kAdamW = OptimizerKind::kAdamW;
const auto kShampoo = OptimizerKind::kShampoo;
const auto kSoap = OptimizerKind::kSoap;

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

TEST(UpdateRuleTest, ShapeRequirements) {
  std::unique_ptr<Backend> backend = CpuBackend();
  ASSERT_NE(backend, nullptr);
  for (OptimizerKind kind : {kMuon, kShampoo, kSoap}) {
    EXPECT_THAT(UpdateRule::Create(Config(kind, {}), {37}, backend.get()),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("2-D")))
        << OptimizerKindName(kind);
    EXPECT_THAT(UpdateRule::Create(Config(kind, {}), {2, 3, 4}, backend.get()),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("2-D")));
    EXPECT_OK(UpdateRule::Create(Config(kind, {}), {1, 5}, backend.get()));
  }
  EXPECT_OK(UpdateRule::Create(Config(kAdamW, {}), {37}, backend.get()));
  EXPECT_OK(UpdateRule::Create(Config(kAdamW, {}), {2, 3, 4}, backend.get()));
  EXPECT_THAT(
      UpdateRule::Create(Config(kAdamW, {}), {0, 4}, backend.get()),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("[0, 4]")));
  // The cpu backend runs Newton-Schulz in fp32 only.
  EXPECT_THAT(
      UpdateRule::Create(Config(kMuon, {{"ns_precision", "bf16"}}), {4, 4},
                         backend.get()),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ns_precision")));
}

TEST(UpdateRuleTest, NewtonSchulzSpecResolution) {
  MuonOptions o;
  ASSERT_OK_AND_ASSIGN(NewtonSchulzSpec cpu,
                       NewtonSchulzSpecFor(o, BackendKind::kCpu));
  EXPECT_EQ(cpu.precision, NsPrecision::kFloat32);
  EXPECT_EQ(cpu.norm_scale, 1.0f);
  EXPECT_EQ(cpu.norm_eps, 1e-7f);
  ASSERT_OK_AND_ASSIGN(NewtonSchulzSpec cuda,
                       NewtonSchulzSpecFor(o, BackendKind::kCuda));
  EXPECT_EQ(cuda.precision, NsPrecision::kBfloat16);
  o.ns_coefficients = NsCoefficients::kPolarExpress;
  o.ns_steps = 7;
  ASSERT_OK_AND_ASSIGN(NewtonSchulzSpec polar,
                       NewtonSchulzSpecFor(o, BackendKind::kCpu));
  ASSERT_EQ(polar.coefficients.size(), 7u);
  EXPECT_EQ(polar.coefficients[6], polar.coefficients[4]);
  EXPECT_FLOAT_EQ(polar.coefficients[0][0], 8.156554524902461f);
  EXPECT_EQ(polar.norm_scale, 1.02f);
  EXPECT_EQ(polar.norm_eps, 1e-6f);
  o.ns_coefficients = NsCoefficients::kQuintic;
  ASSERT_OK_AND_ASSIGN(NewtonSchulzSpec quintic,
                       NewtonSchulzSpecFor(o, BackendKind::kCpu));
  EXPECT_EQ(quintic.coefficients[5], quintic.coefficients[0]);
  EXPECT_EQ(quintic.coefficients[6], quintic.coefficients[1]);
  // ns_algorithm passes through; auto is resolved per shape by the backend.
  EXPECT_EQ(quintic.algorithm, NsAlgorithm::kAuto);
  o.ns_algorithm = NsAlgorithm::kGram;
  ASSERT_OK_AND_ASSIGN(NewtonSchulzSpec gram,
                       NewtonSchulzSpecFor(o, BackendKind::kCuda));
  EXPECT_EQ(gram.algorithm, NsAlgorithm::kGram);
}

TEST(UpdateRuleTest, StateBytesAndNames) {
  std::unique_ptr<Backend> backend = CpuBackend();
  ASSERT_NE(backend, nullptr);
  ASSERT_OK_AND_ASSIGN(
      auto muon, UpdateRule::Create(Config(kMuon, {}), {6, 4}, backend.get()));
  EXPECT_EQ(muon->state_bytes(), 6 * 4 * 4);
  ASSERT_OK_AND_ASSIGN(
      auto adamw,
      UpdateRule::Create(Config(kAdamW, {}), {3, 5, 7}, backend.get()));
  EXPECT_EQ(adamw->state_bytes(), 2 * 105 * 4);
  ASSERT_OK_AND_ASSIGN(OptimizerState s, adamw->SaveState());
  ASSERT_NE(s.FindTensor("exp_avg_sq"), nullptr);
  EXPECT_EQ(s.FindTensor("exp_avg_sq")->shape, (std::vector<int64_t>{3, 5, 7}));
  ASSERT_OK_AND_ASSIGN(
      auto soap, UpdateRule::Create(Config(kSoap, {{"max_precond_dim", "5"}}),
                                    {4, 9}, backend.get()));
  ASSERT_OK_AND_ASSIGN(OptimizerState soap_state, soap->SaveState());
  EXPECT_NE(soap_state.FindTensor("QL"), nullptr);
  EXPECT_EQ(soap_state.FindTensor("QR"), nullptr);  // 9 > 5: identity side
  ASSERT_OK_AND_ASSIGN(
      auto shampoo,
      UpdateRule::Create(Config(kShampoo, {{"max_preconditioner_dim", "4"}}),
                         {6, 4}, backend.get()));
  // Blocks 4x4 and 2x4, each with L, L_inv, R, R_inv, momentum, graft:
  // 4x4: 16 * 6 floats; 2x4: 4 + 4 + 16 + 16 + 8 + 8 floats.
  EXPECT_EQ(shampoo->state_bytes(), 4 * (16 * 6 + 4 + 4 + 16 + 16 + 8 + 8));
}

// ---- Steady-state allocation
// -------------------------------------------------

// Forwards to a cpu backend and counts Allocate calls.
class CountingBackend : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  int64_t allocations() const { return allocations_; }

 private:
  absl::StatusOr<DeviceBuffer> DoAllocate(int64_t count) override {
    ++allocations_;
    return ForwardingBackend::DoAllocate(count);
  }

  int64_t allocations_ = 0;
};

TEST(UpdateRuleTest, StepsAllocateNothingAfterCreate) {
  const std::vector<std::pair<OptimizerKind, Settings>> cases = {
      {kMuon, {}},
      {kAdamW, {}},
      {kShampoo, {{"max_preconditioner_dim", "4"}}},  // column-split blocks
      {kSoap, {{"precondition_frequency", "2"}}}};
  for (const auto& [kind, settings] : cases) {
    SCOPED_TRACE(std::string(OptimizerKindName(kind)));
    CountingBackend backend(CpuBackend());
    ASSERT_OK_AND_ASSIGN(DeviceBuffer param, backend.Allocate(42));
    ASSERT_OK_AND_ASSIGN(DeviceBuffer grad, backend.Allocate(42));
    std::mt19937_64 rng(1);
    const std::vector<float> g = RandomNormal(42, rng, 1.0);
    ASSERT_OK(backend.CopyFromHost(g.data(), 42, grad.data()));
    ASSERT_OK_AND_ASSIGN(auto rule, UpdateRule::Create(Config(kind, settings),
                                                       {7, 6}, &backend));
    const int64_t after_create = backend.allocations();
    for (int i = 0; i < 5; ++i)
      ASSERT_OK(rule->Step(param.data(), grad.data()));
    EXPECT_EQ(backend.allocations(), after_create);
  }
  // A blocked Muon rule's same-shape blocks step as one batch: its
  // scratch and workspace are made at creation too (k and v: 4 x 6 each),
  // and counted as the rule's own memory.
  CountingBackend backend(CpuBackend());
  ASSERT_OK_AND_ASSIGN(DeviceBuffer param, backend.Allocate(96));
  ASSERT_OK_AND_ASSIGN(DeviceBuffer grad, backend.Allocate(96));
  std::mt19937_64 rng(2);
  const std::vector<float> g = RandomNormal(96, rng, 1.0);
  ASSERT_OK(backend.CopyFromHost(g.data(), 96, grad.data()));
  ASSERT_OK_AND_ASSIGN(
      auto blocked,
      UpdateRule::CreateBlocked(Config(kMuon, {}), {16, 6},
                                {.sizes = {4, 2, 2}, .repeat = 2,
                                 .merge_repeats = true},
                                "qkv", &backend));
  EXPECT_GE(blocked->own_bytes(), 2 * 4 * 6 * 4);
  const int64_t after_create = backend.allocations();
  for (int i = 0; i < 3; ++i) {
    ASSERT_OK(blocked->Step(param.data(), grad.data()));
  }
  EXPECT_EQ(backend.allocations(), after_create);
}

// Counts the eigensolves asked of it (each reports to the host: one wait).
class EigenCountingBackend : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  int64_t solves() const { return solves_; }

 protected:
  absl::Status DoSymmetricEigen(int64_t n, float* a, float* w,
                                EigenPrecision p) override {
    ++solves_;
    return ForwardingBackend::DoSymmetricEigen(n, a, w, p);
  }

 private:
  int64_t solves_ = 0;
};

// On a GPU each host wait idles the device behind a round trip, so a step
// waits only where a solver must report to the host, once per solve: the
// eigensolver of Shampoo's root-inverse refresh and of SOAP's first call.
// Shampoo's grafting norm, SOAP's normalize_grads and SOAP's basis sort
// stay on the backend (Backend::ScaleToNorm, SortColumns, SortRows), and so
// do Shampoo's roots of the eigenvalues (LiftedPower: was a copy to the
// host after each solve and a pageable upload back); host_waits counts for
// every backend alike, so the cpu's count is a GPU's.
TEST(UpdateRuleTest, StepsWaitOnTheHostOnlyForAnEigensolver) {
  struct Case {
    OptimizerKind kind;
    Settings settings;
    std::vector<int> solver_steps;  // 1-based steps that may wait
  };
  const std::vector<Case> cases = {
      {kMuon, {}, {}},
      {kAdamW, {}, {}},
      // Refreshes at steps 2, 3 and 6; steps 4, 5 and 7 graft (adam).
      {kShampoo,
       {{"max_preconditioner_dim", "4"},
        {"precondition_frequency", "3"},
        {"start_preconditioning_step", "2"}},
       {2, 3, 6}},
      {kShampoo,
       {{"grafting", "adagrad"},
        {"precondition_frequency", "3"},
        {"start_preconditioning_step", "2"}},
       {2, 3, 6}},
      // Bases from an eigensolver at step 1; sorted refreshes at 3, 5, 7.
      {kSoap,
       {{"precondition_frequency", "2"}, {"normalize_grads", "true"}},
       {1}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(OptimizerKindName(c.kind)));
    auto backend = std::make_unique<EigenCountingBackend>(CpuBackend());
    ASSERT_OK_AND_ASSIGN(DeviceBuffer param, backend->Allocate(42));
    ASSERT_OK_AND_ASSIGN(DeviceBuffer grad, backend->Allocate(42));
    std::mt19937_64 rng(5);
    ASSERT_OK_AND_ASSIGN(
        auto rule,
        UpdateRule::Create(Config(c.kind, c.settings), {7, 6}, backend.get()));
    for (int step = 1; step <= 7; ++step) {
      SCOPED_TRACE(absl::StrCat("step ", step));
      const std::vector<float> g = RandomNormal(42, rng, 1.0);
      ASSERT_OK(backend->CopyFromHost(g.data(), 42, grad.data()));
      const int64_t waits = backend->host_waits();
      const int64_t solves = backend->solves();
      ASSERT_OK(rule->Step(param.data(), grad.data()));
      const bool solver =
          std::count(c.solver_steps.begin(), c.solver_steps.end(), step) > 0;
      EXPECT_EQ(backend->solves() > solves, solver);
      EXPECT_EQ(backend->host_waits() - waits, backend->solves() - solves);
    }
  }
}

// Muon and AdamW queue their update's size in the pass that applies it
// (StepOptions::change): the same parameters as without, and the queued
// sum is the squared distance between the new and old values. Shampoo,
// SOAP and blocked rules refuse it, naming the field, with nothing
// changed.
TEST(UpdateRuleTest, QueuedChangeIsTheUpdatesSquaredSize) {
  std::unique_ptr<Backend> backend = CpuBackend();
  ASSERT_NE(backend, nullptr);
  std::mt19937_64 rng(3);
  const std::vector<float> p0 = RandomNormal(42, rng, 1.0);
  const std::vector<float> g = RandomNormal(42, rng, 1.0);
  for (OptimizerKind kind : {kMuon, kAdamW}) {
    SCOPED_TRACE(std::string(OptimizerKindName(kind)));
    std::vector<DeviceBuffer> params;
    for (int k = 0; k < 3; ++k) {
      ASSERT_OK_AND_ASSIGN(DeviceBuffer b, backend->Allocate(42));
      ASSERT_OK(backend->CopyFromHost(p0.data(), 42, b.data()));
      params.push_back(std::move(b));
    }
    ASSERT_OK_AND_ASSIGN(DeviceBuffer grad, backend->Allocate(42));
    ASSERT_OK(backend->CopyFromHost(g.data(), 42, grad.data()));
    ASSERT_OK_AND_ASSIGN(auto plain, UpdateRule::Create(Config(kind, {}),
                                                        {7, 6}, backend.get()));
    ASSERT_OK_AND_ASSIGN(
        auto counted,
        UpdateRule::Create(Config(kind, {}), {7, 6}, backend.get()));
    EXPECT_TRUE(counted->QueuesChange());
    ASSERT_OK(plain->Step(params[0].data(), grad.data()));
    StepOptions options;
    options.change = SquaredChange::kQueue;
    ASSERT_OK(counted->Step(params[1].data(), grad.data(), options));
    ASSERT_OK_AND_ASSIGN(double queued, backend->TakeSumSquares());
    std::vector<float> a(42), b(42);
    ASSERT_OK(backend->CopyToHost(params[0].data(), 42, a.data()));
    ASSERT_OK(backend->CopyToHost(params[1].data(), 42, b.data()));
    EXPECT_EQ(a, b);
    ASSERT_OK(backend->EnqueueSquaredDistance(42, params[1].data(),
                                              params[2].data()));
    ASSERT_OK_AND_ASSIGN(double distance, backend->TakeSumSquares());
    EXPECT_EQ(queued, distance);
    EXPECT_GT(queued, 0.0);
  }
  for (const auto& [kind, settings] :
       std::vector<std::pair<OptimizerKind, Settings>>{{kShampoo, {}},
                                                       {kSoap, {}}}) {
    ASSERT_OK_AND_ASSIGN(auto rule, UpdateRule::Create(Config(kind, settings),
                                                       {7, 6}, backend.get()));
    EXPECT_FALSE(rule->QueuesChange());
    ASSERT_OK_AND_ASSIGN(DeviceBuffer param, backend->Allocate(42));
    ASSERT_OK_AND_ASSIGN(DeviceBuffer grad, backend->Allocate(42));
    StepOptions options;
    options.change = SquaredChange::kQueue;
    EXPECT_THAT(rule->Step(param.data(), grad.data(), options),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("options.change")));
    ASSERT_OK_AND_ASSIGN(OptimizerState state, rule->SaveState());
    EXPECT_EQ(state.step, 0);
  }
}

// ---- State serialization ----------------------------------------------------

struct StateCase {
  OptimizerKind kind;
  Settings settings;
};

std::vector<StateCase> StateCases() {
  return {{kMuon, {}},
          {kAdamW, {}},
          {kShampoo,
           {{"max_preconditioner_dim", "5"},
            {"precondition_frequency", "2"},
            {"epsilon", "1e-3"}}},
          {kSoap, {{"precondition_frequency", "2"}}}};
}

TEST(UpdateRuleStateTest, RoundTripContinuesBitwiseIdentically) {
  for (const StateCase& sc : StateCases()) {
    SCOPED_TRACE(std::string(OptimizerKindName(sc.kind)));
    const std::vector<int64_t> shape = {8, 6};
    const OptimizerConfig config = Config(sc.kind, sc.settings);
    Harness a, b;
    a.Init(48);
    b.Init(48);
    ASSERT_OK_AND_ASSIGN(auto rule_a,
                         UpdateRule::Create(config, shape, a.backend.get()));
    ASSERT_OK_AND_ASSIGN(auto rule_b,
                         UpdateRule::Create(config, shape, b.backend.get()));
    std::mt19937_64 rng(5);
    const std::vector<float> p0 = RandomNormal(48, rng, 0.2);
    a.SetParam(p0);
    for (int i = 0; i < 3; ++i)
      ASSERT_OK(a.Step(*rule_a, RandomNormal(48, rng, 1.0)));
    ASSERT_OK_AND_ASSIGN(OptimizerState saved, rule_a->SaveState());
    EXPECT_EQ(saved.kind, sc.kind);
    ASSERT_OK(rule_b->LoadState(saved));
    b.SetParam(a.Param());
    ASSERT_OK_AND_ASSIGN(OptimizerState reloaded, rule_b->SaveState());
    EXPECT_TRUE(reloaded == saved);
    for (int i = 0; i < 4; ++i) {
      const std::vector<float> g = RandomNormal(48, rng, 1.0);
      ASSERT_OK(a.Step(*rule_a, g));
      ASSERT_OK(b.Step(*rule_b, g));
    }
    EXPECT_EQ(a.Param(), b.Param());
    ASSERT_OK_AND_ASSIGN(OptimizerState end_a, rule_a->SaveState());
    ASSERT_OK_AND_ASSIGN(OptimizerState end_b, rule_b->SaveState());
    EXPECT_TRUE(end_a == end_b);
    EXPECT_EQ(end_a.step,
              sc.kind == kSoap ? 6 : 7);  // SOAP's first call is init
  }
}

TEST(UpdateRuleStateTest, RejectedLoadChangesNothing) {
  for (const StateCase& sc : StateCases()) {
    SCOPED_TRACE(std::string(OptimizerKindName(sc.kind)));
    const OptimizerConfig config = Config(sc.kind, sc.settings);
    Harness a, b;
    a.Init(48);
    b.Init(48);
    ASSERT_OK_AND_ASSIGN(auto rule_a,
                         UpdateRule::Create(config, {8, 6}, a.backend.get()));
    ASSERT_OK_AND_ASSIGN(auto rule_b,
                         UpdateRule::Create(config, {8, 6}, b.backend.get()));
    std::mt19937_64 rng(9);
    const std::vector<float> p0 = RandomNormal(48, rng, 0.2);
    a.SetParam(p0);
    b.SetParam(p0);
    for (int i = 0; i < 3; ++i) {
      const std::vector<float> g = RandomNormal(48, rng, 1.0);
      ASSERT_OK(a.Step(*rule_a, g));
      ASSERT_OK(b.Step(*rule_b, g));
    }
    // A state from another shape, with its step advanced so that a partial
    // load would show.
    ASSERT_OK_AND_ASSIGN(auto other,
                         UpdateRule::Create(config, {6, 8}, a.backend.get()));
    ASSERT_OK_AND_ASSIGN(OptimizerState wrong_shape, other->SaveState());
    wrong_shape.step = 100;
    for (StateTensor& t : wrong_shape.tensors)
      std::fill(t.data.begin(), t.data.end(), 7.0f);
    EXPECT_THAT(
        rule_a->LoadState(wrong_shape),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("shape")));
    ASSERT_OK_AND_ASSIGN(OptimizerState good, rule_a->SaveState());
    // Wrong kind, missing tensor, wrong data size, negative step.
    OptimizerState wrong_kind = good;
    wrong_kind.kind = sc.kind == kAdamW ? kMuon : kAdamW;
    EXPECT_THAT(rule_a->LoadState(wrong_kind),
                StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
    OptimizerState renamed = good;
    renamed.tensors.back().name = "bogus";
    renamed.tensors.front().data.assign(renamed.tensors.front().data.size(),
                                        7.0f);
    EXPECT_THAT(rule_a->LoadState(renamed),
                StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
    OptimizerState short_data = good;
    short_data.tensors.front().data.assign(3, 7.0f);
    EXPECT_THAT(rule_a->LoadState(short_data),
                StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
    OptimizerState negative = good;
    negative.step = -1;
    EXPECT_THAT(rule_a->LoadState(negative),
                StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
    // The next steps equal those of the rule that never saw the loads.
    for (int i = 0; i < 3; ++i) {
      const std::vector<float> g = RandomNormal(48, rng, 1.0);
      ASSERT_OK(a.Step(*rule_a, g));
      ASSERT_OK(b.Step(*rule_b, g));
    }
    EXPECT_EQ(a.Param(), b.Param());
  }
}

// ---- Batched Muon and the lr override ---------------------------------------

class StepMuonBatchTest : public ::testing::TestWithParam<const char*> {};

// Batched steps equal per-matrix steps with either algorithm.
TEST_P(StepMuonBatchTest, EqualsPerMatrixSteps) {
  const OptimizerConfig config = Config(kMuon, {{"ns_coefficients", "quintic"},
                                                {"weight_decay", "0.1"},
                                                {"ns_algorithm", GetParam()}});
  const std::vector<int64_t> shape = {14, 10};
  const int64_t n = 140, batch = 3;
  std::unique_ptr<Backend> backend = CpuBackend();
  ASSERT_NE(backend, nullptr);
  std::vector<std::unique_ptr<UpdateRule>> batched, single;
  std::vector<DeviceBuffer> pb, ps, gb;
  std::mt19937_64 rng(21);
  for (int64_t i = 0; i < batch; ++i) {
    batched.push_back(*UpdateRule::Create(config, shape, backend.get()));
    single.push_back(*UpdateRule::Create(config, shape, backend.get()));
    const std::vector<float> p0 = RandomNormal(n, rng, 0.2);
    pb.push_back(*backend->Allocate(n));
    ps.push_back(*backend->Allocate(n));
    gb.push_back(*backend->Allocate(n));
    ASSERT_OK(backend->CopyFromHost(p0.data(), n, pb.back().data()));
    ASSERT_OK(backend->CopyFromHost(p0.data(), n, ps.back().data()));
  }
  std::vector<UpdateRule*> rules;
  std::vector<float*> params;
  std::vector<const float*> grads;
  for (int64_t i = 0; i < batch; ++i) {
    rules.push_back(batched[i].get());
    params.push_back(pb[i].data());
    grads.push_back(gb[i].data());
  }
  for (int step = 0; step < 4; ++step) {
    for (int64_t i = 0; i < batch; ++i) {
      const std::vector<float> g = RandomNormal(n, rng, 1.0);
      ASSERT_OK(backend->CopyFromHost(g.data(), n, gb[i].data()));
      ASSERT_OK(single[i]->Step(ps[i].data(), gb[i].data()));
    }
    ASSERT_OK(StepMuonBatch(rules, params, grads, {}));
  }
  for (int64_t i = 0; i < batch; ++i) {
    std::vector<float> a(n), b(n);
    ASSERT_OK(backend->CopyToHost(pb[i].data(), n, a.data()));
    ASSERT_OK(backend->CopyToHost(ps[i].data(), n, b.data()));
    double err = 0, norm = 0;
    for (int64_t j = 0; j < n; ++j) {
      err += (a[j] - b[j]) * (a[j] - b[j]);
      norm += b[j] * b[j];
    }
    EXPECT_LE(std::sqrt(err / norm), 1e-6) << "matrix " << i;
    ASSERT_OK_AND_ASSIGN(OptimizerState sa, batched[i]->SaveState());
    ASSERT_OK_AND_ASSIGN(OptimizerState sb, single[i]->SaveState());
    EXPECT_EQ(sa.step, 4);
    EXPECT_TRUE(sa == sb);  // momentum does not go through Newton-Schulz
  }
  // Mismatched shape or optimizer is refused.
  ASSERT_OK_AND_ASSIGN(auto other,
                       UpdateRule::Create(config, {10, 14}, backend.get()));
  std::vector<UpdateRule*> mixed = {batched[0].get(), other.get()};
  std::vector<float*> two_params = {pb[0].data(), pb[1].data()};
  std::vector<const float*> two_grads = {gb[0].data(), gb[1].data()};
  EXPECT_THAT(StepMuonBatch(mixed, two_params, two_grads, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("shape")));
  ASSERT_OK_AND_ASSIGN(
      auto adamw, UpdateRule::Create(Config(kAdamW, {}), shape, backend.get()));
  mixed = {batched[0].get(), adamw.get()};
  EXPECT_THAT(StepMuonBatch(mixed, two_params, two_grads, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("adamw")));
}

INSTANTIATE_TEST_SUITE_P(Algorithms, StepMuonBatchTest,
                         ::testing::Values("standard", "gram"));

// One group's AdamW tensors of any shapes step in one backend call,
// bitwise the per-tensor steps, the lr override and the queued change sums
// included; rules at different steps (a state loaded for one) step one by
// one, still right.
TEST(StepAdamWBatchTest, EqualsPerTensorStepsInOneBackendCall) {
  class CountingBackend : public ForwardingBackend {
   public:
    using ForwardingBackend::ForwardingBackend;
    int many = 0;

   protected:
    absl::Status DoAdamWStepMany(absl::Span<const AdamWTensor> tensors,
                                 float lr, float b1, float b2, float eps,
                                 float wd, int64_t step,
                                 SquaredChange change) override {
      ++many;
      return ForwardingBackend::DoAdamWStepMany(tensors, lr, b1, b2, eps, wd,
                                                step, change);
    }
  };
  CountingBackend backend(CpuBackend());
  const OptimizerConfig config = Config(kAdamW, {{"weight_decay", "0.1"}});
  const std::vector<std::vector<int64_t>> shapes = {{10}, {4, 6}, {128}};
  std::vector<std::unique_ptr<UpdateRule>> batched, single;
  std::vector<DeviceBuffer> pb, ps, gb;
  std::mt19937_64 rng(23);
  std::vector<UpdateRule*> rules;
  std::vector<float*> params;
  std::vector<const float*> grads;
  for (const std::vector<int64_t>& shape : shapes) {
    const int64_t n = NumElements(shape);
    batched.push_back(*UpdateRule::Create(config, shape, &backend));
    single.push_back(*UpdateRule::Create(config, shape, &backend));
    const std::vector<float> p0 = RandomNormal(n, rng, 0.2);
    pb.push_back(*backend.Allocate(n));
    ps.push_back(*backend.Allocate(n));
    gb.push_back(*backend.Allocate(n));
    ASSERT_OK(backend.CopyFromHost(p0.data(), n, pb.back().data()));
    ASSERT_OK(backend.CopyFromHost(p0.data(), n, ps.back().data()));
    rules.push_back(batched.back().get());
    params.push_back(pb.back().data());
    grads.push_back(gb.back().data());
  }
  auto compare = [&] {
    for (size_t i = 0; i < shapes.size(); ++i) {
      const int64_t n = NumElements(shapes[i]);
      std::vector<float> a(n), b(n);
      ASSERT_OK(backend.CopyToHost(pb[i].data(), n, a.data()));
      ASSERT_OK(backend.CopyToHost(ps[i].data(), n, b.data()));
      EXPECT_EQ(a, b) << "tensor " << i;
      ASSERT_OK_AND_ASSIGN(OptimizerState sa, batched[i]->SaveState());
      ASSERT_OK_AND_ASSIGN(OptimizerState sb, single[i]->SaveState());
      EXPECT_TRUE(sa == sb) << "tensor " << i;
    }
  };
  const StepOptions options = {.lr = 0.02f, .change = SquaredChange::kQueue};
  for (int step = 0; step < 3; ++step) {
    for (size_t i = 0; i < shapes.size(); ++i) {
      const int64_t n = NumElements(shapes[i]);
      const std::vector<float> g = RandomNormal(n, rng, 1.0);
      ASSERT_OK(backend.CopyFromHost(g.data(), n, gb[i].data()));
      ASSERT_OK(single[i]->Step(ps[i].data(), gb[i].data(), options));
    }
    ASSERT_OK_AND_ASSIGN(const double single_sum, backend.TakeSumSquares());
    ASSERT_OK(StepAdamWBatch(rules, params, grads, options));
    ASSERT_OK_AND_ASSIGN(const double batched_sum, backend.TakeSumSquares());
    EXPECT_EQ(batched_sum, single_sum);
    EXPECT_GT(batched_sum, 0);
  }
  EXPECT_EQ(backend.many, 3);
  compare();
  // One rule a step behind (its state loaded from another step): one by one.
  ASSERT_OK_AND_ASSIGN(OptimizerState behind, batched[1]->SaveState());
  behind.step = 2;
  ASSERT_OK(batched[1]->LoadState(behind));
  ASSERT_OK(single[1]->LoadState(behind));
  for (size_t i = 0; i < shapes.size(); ++i) {
    ASSERT_OK(single[i]->Step(ps[i].data(), gb[i].data(), options));
  }
  ASSERT_OK(StepAdamWBatch(rules, params, grads, options));
  EXPECT_EQ(backend.many, 3);
  compare();
  // A rule of another optimizer or config is refused.
  ASSERT_OK_AND_ASSIGN(auto muon,
                       UpdateRule::Create(Config(kMuon, {}), {4, 6}, &backend));
  std::vector<UpdateRule*> mixed = {rules[0], muon.get()};
  std::vector<float*> two_params = {params[0], params[1]};
  std::vector<const float*> two_grads = {grads[0], grads[1]};
  EXPECT_THAT(StepAdamWBatch(mixed, two_params, two_grads, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("muon")));
  ASSERT_OK_AND_ASSIGN(
      auto other, UpdateRule::Create(Config(kAdamW, {{"weight_decay", "0"}}),
                                     {4, 6}, &backend));
  mixed = {rules[0], other.get()};
  EXPECT_THAT(
      StepAdamWBatch(mixed, two_params, two_grads, {}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("config")));
}

TEST(StepOptionsTest, LrOverrideScalesTheUpdate) {
  for (OptimizerKind kind : {kMuon, kAdamW, kShampoo, kSoap}) {
    SCOPED_TRACE(std::string(OptimizerKindName(kind)));
    // No weight decay, so the displacement of one step is linear in lr.
    const OptimizerConfig config = Config(kind, {{"weight_decay", "0"}});
    std::mt19937_64 rng(3);
    const std::vector<float> p0 = RandomNormal(30, rng, 0.2);
    const std::vector<float> g0 = RandomNormal(30, rng, 1.0);
    const std::vector<float> g1 = RandomNormal(30, rng, 1.0);
    std::vector<double> norms;
    for (std::optional<float> lr :
         {std::optional<float>(),
          std::optional<float>(3 * ConfigLearningRate(config))}) {
      Harness h;
      h.Init(30);
      ASSERT_OK_AND_ASSIGN(auto rule,
                           UpdateRule::Create(config, {5, 6}, h.backend.get()));
      h.SetParam(p0);
      ASSERT_OK(h.Step(*rule, g0));  // SOAP's init call; a plain step otherwise
      const std::vector<float> before = h.Param();
      ASSERT_OK(h.Step(*rule, g1, StepOptions{lr}));
      const std::vector<float> after = h.Param();
      double s = 0;
      for (int i = 0; i < 30; ++i)
        s += (after[i] - before[i]) * (after[i] - before[i]);
      norms.push_back(std::sqrt(s));
    }
    ASSERT_GT(norms[0], 0);
    EXPECT_NEAR(norms[1] / norms[0], 3.0, 1e-4);
  }
  Harness h;
  h.Init(30);
  ASSERT_OK_AND_ASSIGN(auto rule, UpdateRule::Create(Config(kMuon, {}), {5, 6},
                                                     h.backend.get()));
  EXPECT_THAT(h.Step(*rule, std::vector<float>(30, 1.0f), StepOptions{-1.0f}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("lr")));
}

}  // namespace
}  // namespace canzona
