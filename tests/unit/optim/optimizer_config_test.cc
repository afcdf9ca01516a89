#include "server/optim/optimizer_config.h"

#include <cmath>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/matchers/status_matchers.h"

namespace canzona {
namespace {

using ::canzona::testing::IsOk;
using ::canzona::testing::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Pair;
using Settings = std::vector<std::pair<std::string, std::string>>;

TEST(OptimizerKindTest, NamesRoundTrip) {
  for (OptimizerKind kind : {OptimizerKind::kMuon, OptimizerKind::kAdamW,
                             OptimizerKind::kShampoo, OptimizerKind::kSoap}) {
    ASSERT_OK_AND_ASSIGN(OptimizerKind parsed,
                         ParseOptimizerKind(OptimizerKindName(kind)));
    EXPECT_EQ(parsed, kind);
  }
  EXPECT_EQ(OptimizerKindName(OptimizerKind::kSoap), "soap");
}

TEST(OptimizerKindTest, UnknownOptimizerNamesTheValue) {
  EXPECT_THAT(ParseOptimizerKind("lion"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("lion")));
  EXPECT_THAT(ParseOptimizerKind("Muon"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("Muon")));
}

TEST(OptimizerConfigTest, DefaultsAreTheReferenceImplementations) {
  ASSERT_OK_AND_ASSIGN(OptimizerConfig muon,
                       MakeOptimizerConfig(OptimizerKind::kMuon, {}));
  EXPECT_EQ(muon.kind, OptimizerKind::kMuon);
  EXPECT_EQ(muon.muon.momentum, 0.95);
  EXPECT_TRUE(muon.muon.nesterov);
  EXPECT_EQ(muon.muon.ns_steps, 5);
  EXPECT_EQ(muon.muon.ns_coefficients, NsCoefficients::kSimple);
  EXPECT_EQ(muon.muon.scale, MuonScale::kSpectral);
  EXPECT_EQ(muon.muon.weight_decay, 0.0);
  EXPECT_EQ(muon.muon.eps, 1e-7);
  EXPECT_EQ(muon.muon.ns_precision, NsPrecisionOption::kAuto);
  EXPECT_EQ(muon.muon.ns_algorithm, NsAlgorithm::kAuto);

  const AdamWOptions adamw;
  EXPECT_EQ(adamw.beta1, 0.9);
  EXPECT_EQ(adamw.beta2, 0.999);
  EXPECT_EQ(adamw.eps, 1e-8);
  EXPECT_EQ(adamw.weight_decay, 0.01);

  const ShampooOptions shampoo;
  EXPECT_EQ(shampoo.beta1, 0.9);
  EXPECT_EQ(shampoo.beta2, 1.0);
  EXPECT_EQ(shampoo.epsilon, 1e-12);
  EXPECT_EQ(shampoo.weight_decay, 0.0);
  EXPECT_EQ(shampoo.max_preconditioner_dim, 1024);
  EXPECT_EQ(shampoo.precondition_frequency, 1);
  EXPECT_EQ(shampoo.start_preconditioning_step, -1);
  EXPECT_EQ(shampoo.start_step(), 1);
  EXPECT_EQ(shampoo.grafting, Grafting::kAdam);
  EXPECT_EQ(shampoo.grafting_beta2, 0.999);
  EXPECT_EQ(shampoo.grafting_epsilon, 1e-8);

  const SoapOptions soap;
  EXPECT_EQ(soap.lr, 3e-3);
  EXPECT_EQ(soap.beta1, 0.95);
  EXPECT_EQ(soap.beta2, 0.95);
  EXPECT_EQ(soap.shampoo_beta, -1.0);
  EXPECT_EQ(soap.resolved_shampoo_beta(), 0.95);
  EXPECT_EQ(soap.eps, 1e-8);
  EXPECT_EQ(soap.weight_decay, 0.01);
  EXPECT_EQ(soap.precondition_frequency, 10);
  EXPECT_EQ(soap.max_precond_dim, 10000);
  EXPECT_FALSE(soap.normalize_grads);
  EXPECT_TRUE(soap.correct_bias);
}

TEST(ParseSettingsTest, OrderedPairsWithWhitespaceDropped) {
  ASSERT_OK_AND_ASSIGN(
      Settings settings,
      ParseSettings(" lr=0.02, momentum = 0.95 ,nesterov=false"));
  EXPECT_THAT(settings,
              ElementsAre(Pair("lr", "0.02"), Pair("momentum", "0.95"),
                          Pair("nesterov", "false")));
  ASSERT_OK_AND_ASSIGN(Settings empty, ParseSettings("  "));
  EXPECT_TRUE(empty.empty());
}

TEST(ParseSettingsTest, MalformedTextIsInvalidArgument) {
  EXPECT_THAT(ParseSettings("lr"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("lr")));
  EXPECT_THAT(ParseSettings("lr=0.1,,momentum=0.9"),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  EXPECT_THAT(ParseSettings("=0.1"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("key")));
  EXPECT_THAT(
      ParseSettings("momentum="),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("momentum")));
  EXPECT_THAT(ParseSettings("lr=1,lr=2"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("lr")));
}

TEST(MakeOptimizerConfigTest, AppliesSettings) {
  ASSERT_OK_AND_ASSIGN(
      OptimizerConfig config,
      MakeOptimizerConfig(OptimizerKind::kMuon,
                          {{"lr", "0.05"},
                           {"momentum", "0.9"},
                           {"nesterov", "false"},
                           {"ns_steps", "7"},
                           {"ns_coefficients", "polar_express"},
                           {"scale", "match_rms_adamw"},
                           {"ns_precision", "fp32"},
                           {"ns_algorithm", "gram"}}));
  EXPECT_EQ(config.muon.lr, 0.05);
  EXPECT_EQ(config.muon.momentum, 0.9);
  EXPECT_FALSE(config.muon.nesterov);
  EXPECT_EQ(config.muon.ns_steps, 7);
  EXPECT_EQ(config.muon.ns_coefficients, NsCoefficients::kPolarExpress);
  EXPECT_EQ(config.muon.scale, MuonScale::kMatchRmsAdamW);
  EXPECT_EQ(config.muon.ns_precision, NsPrecisionOption::kFp32);
  EXPECT_EQ(config.muon.ns_algorithm, NsAlgorithm::kGram);

  ASSERT_OK_AND_ASSIGN(OptimizerConfig shampoo,
                       MakeOptimizerConfig(OptimizerKind::kShampoo,
                                           {{"grafting", "adagrad"},
                                            {"start_preconditioning_step", "5"},
                                            {"precondition_frequency", "2"}}));
  EXPECT_EQ(shampoo.shampoo.grafting, Grafting::kAdagrad);
  EXPECT_EQ(shampoo.shampoo.start_step(), 5);
}

TEST(MakeOptimizerConfigTest, ErrorsNameTheKey) {
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  // Malformed number, bool, enum, integer.
  EXPECT_THAT(MakeOptimizerConfig(OptimizerKind::kMuon, {{"momentum", "high"}}),
              StatusIs(kInvalid, HasSubstr("momentum")));
  EXPECT_THAT(
      MakeOptimizerConfig(OptimizerKind::kMuon, {{"nesterov", "maybe"}}),
      StatusIs(kInvalid, HasSubstr("nesterov")));
  EXPECT_THAT(
      MakeOptimizerConfig(OptimizerKind::kMuon, {{"ns_coefficients", "cubic"}}),
      StatusIs(kInvalid, HasSubstr("ns_coefficients")));
  for (const char* bad : {"syrk", "Gram", "GRAM", "standard ", "1"}) {
    EXPECT_THAT(
        MakeOptimizerConfig(OptimizerKind::kMuon, {{"ns_algorithm", bad}}),
        StatusIs(kInvalid, HasSubstr("ns_algorithm")))
        << bad;
  }
  // Muon's only: AdamW has no Newton-Schulz.
  EXPECT_THAT(
      MakeOptimizerConfig(OptimizerKind::kAdamW, {{"ns_algorithm", "gram"}}),
      StatusIs(kInvalid, HasSubstr("ns_algorithm")));
  EXPECT_THAT(MakeOptimizerConfig(OptimizerKind::kMuon, {{"ns_steps", "2.5"}}),
              StatusIs(kInvalid, HasSubstr("ns_steps")));
  EXPECT_THAT(MakeOptimizerConfig(OptimizerKind::kAdamW, {{"lr", "nan"}}),
              StatusIs(kInvalid, HasSubstr("lr")));
  // Out of range.
  EXPECT_THAT(MakeOptimizerConfig(OptimizerKind::kMuon, {{"momentum", "1"}}),
              StatusIs(kInvalid, HasSubstr("momentum")));
  EXPECT_THAT(MakeOptimizerConfig(OptimizerKind::kAdamW, {{"lr", "-0.1"}}),
              StatusIs(kInvalid, HasSubstr("lr")));
  EXPECT_THAT(MakeOptimizerConfig(OptimizerKind::kAdamW, {{"beta2", "-0.5"}}),
              StatusIs(kInvalid, HasSubstr("beta2")));
  EXPECT_THAT(MakeOptimizerConfig(OptimizerKind::kAdamW, {{"eps", "0"}}),
              StatusIs(kInvalid, HasSubstr("eps")));
  EXPECT_THAT(MakeOptimizerConfig(OptimizerKind::kShampoo, {{"epsilon", "-1"}}),
              StatusIs(kInvalid, HasSubstr("epsilon")));
  EXPECT_THAT(MakeOptimizerConfig(OptimizerKind::kShampoo,
                                  {{"precondition_frequency", "0"}}),
              StatusIs(kInvalid, HasSubstr("precondition_frequency")));
  EXPECT_THAT(MakeOptimizerConfig(OptimizerKind::kShampoo,
                                  {{"start_preconditioning_step", "0"}}),
              StatusIs(kInvalid, HasSubstr("start_preconditioning_step")));
  EXPECT_THAT(
      MakeOptimizerConfig(OptimizerKind::kSoap, {{"shampoo_beta", "1"}}),
      StatusIs(kInvalid, HasSubstr("shampoo_beta")));
  // Unknown for that optimizer (momentum is muon's, not adamw's).
  EXPECT_THAT(MakeOptimizerConfig(OptimizerKind::kAdamW, {{"momentum", "0.9"}}),
              StatusIs(kInvalid, HasSubstr("momentum")));
  EXPECT_THAT(MakeOptimizerConfig(OptimizerKind::kSoap, {{"grafting", "adam"}}),
              StatusIs(kInvalid, HasSubstr("grafting")));
}

TEST(MakeOptimizerConfigTest, ConfigSettingsRoundTrips) {
  const std::vector<std::pair<OptimizerKind, Settings>> cases = {
      {OptimizerKind::kMuon,
       {{"lr", "0.013"}, {"ns_coefficients", "quintic"}, {"eps", "3e-9"}}},
      {OptimizerKind::kMuon, {{"ns_algorithm", "standard"}}},
      {OptimizerKind::kMuon, {{"ns_algorithm", "gram"}}},
      {OptimizerKind::kAdamW, {{"lr", "0.1"}, {"beta2", "0.98"}}},
      {OptimizerKind::kShampoo,
       {{"grafting", "none"},
        {"beta2", "0.999"},
        {"max_preconditioner_dim", "8"}}},
      {OptimizerKind::kSoap,
       {{"normalize_grads", "true"}, {"shampoo_beta", "0.9"}, {"lr", "1e-3"}}},
  };
  for (const auto& [kind, settings] : cases) {
    ASSERT_OK_AND_ASSIGN(OptimizerConfig config,
                         MakeOptimizerConfig(kind, settings));
    const Settings printed = ConfigSettings(config);
    ASSERT_OK_AND_ASSIGN(OptimizerConfig back,
                         MakeOptimizerConfig(kind, printed));
    EXPECT_TRUE(back == config) << OptimizerKindName(kind);
    // The printed form is the short one a user would write.
    for (const auto& [key, value] : settings) {
      for (const auto& [pkey, pvalue] : printed) {
        if (pkey == key && key != "lr" && key != "eps")
          EXPECT_EQ(pvalue, value);
      }
    }
  }
  ASSERT_OK_AND_ASSIGN(OptimizerConfig muon,
                       MakeOptimizerConfig(OptimizerKind::kMuon, {}));
  EXPECT_THAT(ConfigSettings(muon),
              ::testing::Contains(Pair("momentum", "0.95")));
  EXPECT_THAT(ConfigSettings(muon), ::testing::Contains(Pair("eps", "1e-07")));
}

// What a step may change (StepRequest.settings) and what it may not.
TEST(ScheduleSettingsTest, OnlyTheScheduledKeysInRegistersRanges) {
  ASSERT_OK_AND_ASSIGN(
      OptimizerConfig muon,
      MakeOptimizerConfig(OptimizerKind::kMuon,
                          {{"momentum", "0.9"}, {"ns_steps", "4"}}));
  ASSERT_OK_AND_ASSIGN(
      OptimizerConfig warm,
      ScheduleSettings(muon, {{"momentum", 0.85}, {"weight_decay", 0.1}}));
  EXPECT_EQ(warm.muon.momentum, 0.85);
  EXPECT_EQ(warm.muon.weight_decay, 0.1);
  EXPECT_EQ(warm.muon.ns_steps, 4);
  EXPECT_EQ(warm.muon.lr, muon.muon.lr);
  EXPECT_TRUE(DifferOnlyInScheduled(muon, warm));
  // Not a scheduled key: named, with the ones that are.
  EXPECT_THAT(ScheduleSettings(muon, {{"ns_steps", 3}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("setting ns_steps"),
                             HasSubstr("momentum, weight_decay"))));
  EXPECT_THAT(ScheduleSettings(muon, {{"lr", 0.1}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("setting lr: a step's learning rate goes in "
                                 "StepRequest.lr")));
  // Register's ranges, and numbers only.
  EXPECT_THAT(
      ScheduleSettings(muon, {{"momentum", 1.0}}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("in [0, 1)")));
  EXPECT_THAT(ScheduleSettings(muon, {{"weight_decay", std::nan("")}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("a finite number")));
  // Each kind's keys are its own, and exact doubles survive.
  for (OptimizerKind kind : {OptimizerKind::kMuon, OptimizerKind::kAdamW,
                             OptimizerKind::kShampoo, OptimizerKind::kSoap}) {
    SCOPED_TRACE(std::string(OptimizerKindName(kind)));
    ASSERT_OK_AND_ASSIGN(OptimizerConfig registered,
                         MakeOptimizerConfig(kind, {}));
    std::map<std::string, double> values;
    for (const std::string& key : ScheduledSettingNames(kind)) {
      values[key] = 0.1 + 1e-13;  // in every scheduled key's range
    }
    ASSERT_OK_AND_ASSIGN(OptimizerConfig changed,
                         ScheduleSettings(registered, values));
    EXPECT_NE(changed, registered);
    EXPECT_TRUE(DifferOnlyInScheduled(registered, changed));
    for (const auto& [key, text] : ConfigSettings(changed)) {
      if (values.count(key)) EXPECT_EQ(std::stod(text), 0.1 + 1e-13) << key;
    }
  }
  // Shampoo's beta1 is scheduled where a momentum buffer exists (beta1 > 0
  // at Register), down to 0 included; turned on from a registered 0 it is
  // refused by name, and a rule would refuse such a config too.
  ASSERT_OK_AND_ASSIGN(OptimizerConfig shampoo,
                       MakeOptimizerConfig(OptimizerKind::kShampoo, {}));
  ASSERT_OK_AND_ASSIGN(OptimizerConfig no_momentum,
                       ScheduleSettings(shampoo, {{"beta1", 0.0}}));
  EXPECT_TRUE(DifferOnlyInScheduled(shampoo, no_momentum));
  ASSERT_OK_AND_ASSIGN(
      OptimizerConfig registered_without,
      MakeOptimizerConfig(OptimizerKind::kShampoo, {{"beta1", "0"}}));
  EXPECT_THAT(ScheduleSettings(registered_without, {{"beta1", 0.5}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("setting beta1: shampoo registered with "
                                 "beta1 0 keeps no momentum")));
  EXPECT_OK(ScheduleSettings(registered_without, {{"beta2", 0.5}}));
  EXPECT_FALSE(DifferOnlyInScheduled(registered_without, shampoo));
  ASSERT_OK_AND_ASSIGN(
      OptimizerConfig fewer_steps,
      MakeOptimizerConfig(OptimizerKind::kMuon,
                          {{"momentum", "0.9"}, {"ns_steps", "3"}}));
  EXPECT_FALSE(DifferOnlyInScheduled(muon, fewer_steps));
}

}  // namespace
}  // namespace canzona
