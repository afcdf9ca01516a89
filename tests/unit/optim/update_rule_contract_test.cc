// The update rules' contracts on the cpu backend: shape requirements,
// Newton-Schulz spec resolution, state sizes and names, no allocation and
// no host wait but an eigensolver's in a step, the queued update size,
// state that round-trips bitwise and rejected loads that change nothing,
// batched Muon and AdamW steps equal to one per matrix, per-step options.
// Their accuracy against float64 references is in update_rule_test.cc.
#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "server/optim/update_rule.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/optim/forwarding_backend.h"
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
using ::canzona::optim_test::RandomNormal;
using ::canzona::optim_test::Settings;
using ::canzona::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

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
      UpdateRule::CreateBlocked(
          Config(kMuon, {}), {16, 6},
          {.sizes = {4, 2, 2}, .repeat = 2, .merge_repeats = true}, "qkv",
          &backend));
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

// Scheduled settings (StepOptions::settings) hold for their step only:
// a rule stepped once with them, then once without, equals a rule created
// with them for the first step whose state a rule created with the
// registered settings takes over for the second (bitwise; SOAP's first
// call only initializes, so its steps are its second and third).
TEST(StepOptionsTest, ScheduledSettingsHoldForTheirStepOnly) {
  const std::vector<std::tuple<OptimizerKind, Settings, Settings>> cases = {
      {kMuon, {}, {{"momentum", "0.5"}, {"weight_decay", "0.3"}}},
      {kAdamW, {}, {{"beta1", "0.5"}, {"beta2", "0.9"}, {"eps", "1e-3"}}},
      {kShampoo,
       {{"beta2", "0.9"}},
       {{"beta1", "0.5"},
        {"beta2", "0.5"},
        {"epsilon", "1e-3"},
        {"weight_decay", "0.2"}}},
      {kSoap,
       {},
       {{"beta1", "0.5"}, {"beta2", "0.8"}, {"weight_decay", "0.2"}}},
  };
  for (const auto& [kind, registered_settings, scheduled_settings] : cases) {
    SCOPED_TRACE(std::string(OptimizerKindName(kind)));
    const OptimizerConfig registered = Config(kind, registered_settings);
    Settings both = registered_settings;
    both.insert(both.end(), scheduled_settings.begin(),
                scheduled_settings.end());
    const OptimizerConfig scheduled = Config(kind, both);
    ASSERT_TRUE(DifferOnlyInScheduled(registered, scheduled));
    std::mt19937_64 rng(11);
    const std::vector<float> p0 = RandomNormal(30, rng, 0.2);
    std::vector<std::vector<float>> grads;
    for (int k = 0; k < 3; ++k) grads.push_back(RandomNormal(30, rng, 1.0));
    const int first = kind == kSoap ? 1 : 0;  // SOAP's init call

    Harness a;
    a.Init(30);
    ASSERT_OK_AND_ASSIGN(
        auto rule, UpdateRule::Create(registered, {5, 6}, a.backend.get()));
    a.SetParam(p0);
    StepOptions with;
    with.settings = &scheduled;
    if (first == 1) ASSERT_OK(a.Step(*rule, grads[0]));
    ASSERT_OK(a.Step(*rule, grads[first], with));
    const std::vector<float> a1 = a.Param();
    ASSERT_OK(a.Step(*rule, grads[first + 1]));
    const std::vector<float> a2 = a.Param();

    Harness b;
    b.Init(30);
    ASSERT_OK_AND_ASSIGN(
        auto b_rule, UpdateRule::Create(scheduled, {5, 6}, b.backend.get()));
    b.SetParam(p0);
    if (first == 1) ASSERT_OK(b.Step(*b_rule, grads[0]));
    ASSERT_OK(b.Step(*b_rule, grads[first]));
    EXPECT_EQ(b.Param(), a1);
    ASSERT_OK_AND_ASSIGN(OptimizerState state, b_rule->SaveState());
    ASSERT_OK_AND_ASSIGN(
        auto c_rule, UpdateRule::Create(registered, {5, 6}, b.backend.get()));
    ASSERT_OK(c_rule->LoadState(state));
    ASSERT_OK(b.Step(*c_rule, grads[first + 1]));
    EXPECT_EQ(b.Param(), a2);

    // The negative control: without the settings the first step differs.
    Harness d;
    d.Init(30);
    ASSERT_OK_AND_ASSIGN(
        auto d_rule, UpdateRule::Create(registered, {5, 6}, d.backend.get()));
    d.SetParam(p0);
    if (first == 1) ASSERT_OK(d.Step(*d_rule, grads[0]));
    ASSERT_OK(d.Step(*d_rule, grads[first]));
    EXPECT_NE(d.Param(), a1);
  }
  // Settings that differ in more than the scheduled ones are refused, and
  // the rule steps on as before.
  Harness h;
  h.Init(30);
  const OptimizerConfig muon = Config(kMuon, {});
  ASSERT_OK_AND_ASSIGN(auto rule,
                       UpdateRule::Create(muon, {5, 6}, h.backend.get()));
  const OptimizerConfig other = Config(kMuon, {{"ns_steps", "3"}});
  StepOptions bad;
  bad.settings = &other;
  EXPECT_THAT(h.Step(*rule, std::vector<float>(30, 1.0f), bad),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("options.settings"),
                             HasSubstr("momentum, weight_decay"))));
  EXPECT_OK(h.Step(*rule, std::vector<float>(30, 1.0f)));
}

}  // namespace
}  // namespace canzona
