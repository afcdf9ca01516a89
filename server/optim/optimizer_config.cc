#include "server/optim/optimizer_config.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <set>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "kernels/base/status_macros.h"

namespace canzona {
namespace {

// Shortest "%.*g" spelling that parses back to the same double, so settings
// printed by ConfigSettings read as the user would have written them.
std::string FormatDouble(double value) {
  char buffer[64];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buffer, sizeof(buffer), "%.*g", precision, value);
    double back = 0;
    if (absl::SimpleAtod(buffer, &back) && back == value) break;
  }
  return buffer;
}

absl::Status BadValue(absl::string_view key, absl::string_view value,
                      absl::string_view expected) {
  return absl::InvalidArgumentError(
      absl::StrCat("setting ", key, ": bad value \"", value, "\" (expected ",
                   expected, ")"));
}

// A number with an optional range check; `ok` says whether it is in range
// and `range` describes the range for the message.
absl::StatusOr<double> ParseDouble(absl::string_view key,
                                   absl::string_view value,
                                   const std::function<bool(double)>& ok,
                                   absl::string_view range) {
  double parsed = 0;
  if (!absl::SimpleAtod(value, &parsed) || !std::isfinite(parsed)) {
    return BadValue(key, value, "a finite number");
  }
  if (!ok(parsed)) return BadValue(key, value, range);
  return parsed;
}

absl::StatusOr<int64_t> ParseInt(absl::string_view key, absl::string_view value,
                                 const std::function<bool(int64_t)>& ok,
                                 absl::string_view range) {
  int64_t parsed = 0;
  if (!absl::SimpleAtoi(value, &parsed)) {
    return BadValue(key, value, "an integer");
  }
  if (!ok(parsed)) return BadValue(key, value, range);
  return parsed;
}

absl::StatusOr<bool> ParseBool(absl::string_view key, absl::string_view value) {
  std::string lower = absl::AsciiStrToLower(value);
  if (lower == "true" || lower == "1") return true;
  if (lower == "false" || lower == "0") return false;
  return BadValue(key, value, "true or false");
}

// One hyperparameter: how to set it from text, how to print it, and how to
// copy it from one config to another (no text: DifferOnlyInScheduled runs
// per rule in a step).
struct Field {
  std::string key;
  std::function<absl::Status(absl::string_view, OptimizerConfig&)> set;
  std::function<std::string(const OptimizerConfig&)> get;
  std::function<void(const OptimizerConfig& from, OptimizerConfig& to)> copy;
};

// Field helpers bound to `options` (which options struct of the config) and
// `member` (which field of it).
template <typename Options>
using OptionsOf = Options OptimizerConfig::*;

template <typename Options, typename T>
std::function<void(const OptimizerConfig&, OptimizerConfig&)> CopyOf(
    OptionsOf<Options> options, T Options::*member) {
  return [options, member](const OptimizerConfig& from, OptimizerConfig& to) {
    (to.*options).*member = (from.*options).*member;
  };
}

template <typename Options>
Field DoubleField(std::string key, OptionsOf<Options> options,
                  double Options::*member, std::function<bool(double)> ok,
                  std::string range) {
  Field field;
  field.key = key;
  field.set = [key, options, member, ok, range](absl::string_view value,
                                                OptimizerConfig& config) {
    CANZONA_ASSIGN_OR_RETURN(double parsed, ParseDouble(key, value, ok, range));
    (config.*options).*member = parsed;
    return absl::OkStatus();
  };
  field.get = [options, member](const OptimizerConfig& config) {
    return FormatDouble((config.*options).*member);
  };
  field.copy = CopyOf(options, member);
  return field;
}

template <typename Options>
Field IntField(std::string key, OptionsOf<Options> options,
               int64_t Options::*member, std::function<bool(int64_t)> ok,
               std::string range) {
  Field field;
  field.key = key;
  field.set = [key, options, member, ok, range](absl::string_view value,
                                                OptimizerConfig& config) {
    CANZONA_ASSIGN_OR_RETURN(int64_t parsed, ParseInt(key, value, ok, range));
    (config.*options).*member = parsed;
    return absl::OkStatus();
  };
  field.get = [options, member](const OptimizerConfig& config) {
    return absl::StrCat((config.*options).*member);
  };
  field.copy = CopyOf(options, member);
  return field;
}

template <typename Options>
Field BoolField(std::string key, OptionsOf<Options> options,
                bool Options::*member) {
  Field field;
  field.key = key;
  field.set = [key, options, member](absl::string_view value,
                                     OptimizerConfig& config) {
    CANZONA_ASSIGN_OR_RETURN(bool parsed, ParseBool(key, value));
    (config.*options).*member = parsed;
    return absl::OkStatus();
  };
  field.get = [options, member](const OptimizerConfig& config) {
    return std::string((config.*options).*member ? "true" : "false");
  };
  field.copy = CopyOf(options, member);
  return field;
}

// An enum field; `values` lists every value, `name` spells one.
template <typename Options, typename Enum>
Field EnumField(std::string key, OptionsOf<Options> options,
                Enum Options::*member, std::vector<Enum> values,
                absl::string_view (*name)(Enum)) {
  Field field;
  field.key = key;
  field.set = [key, options, member, values, name](absl::string_view value,
                                                   OptimizerConfig& config) {
    for (Enum candidate : values) {
      if (name(candidate) == value) {
        (config.*options).*member = candidate;
        return absl::OkStatus();
      }
    }
    std::vector<std::string> names;
    for (Enum candidate : values) names.emplace_back(name(candidate));
    return BadValue(key, value, absl::StrJoin(names, " | "));
  };
  field.get = [options, member, name](const OptimizerConfig& config) {
    return std::string(name((config.*options).*member));
  };
  field.copy = CopyOf(options, member);
  return field;
}

constexpr auto Muon = &OptimizerConfig::muon;
constexpr auto AdamW = &OptimizerConfig::adamw;
constexpr auto Shampoo = &OptimizerConfig::shampoo;
constexpr auto Soap = &OptimizerConfig::soap;

bool NonNegative(double x) { return x >= 0; }
bool Positive(double x) { return x > 0; }
bool UnitInterval(double x) { return x >= 0 && x < 1; }    // [0, 1)
bool OpenClosedUnit(double x) { return x > 0 && x <= 1; }  // (0, 1]
bool AtLeastOne(int64_t x) { return x >= 1; }
// Newton-Schulz iterations: 5 is usual; far more only burns compute (and a
// huge count would allocate its coefficient table per step).
bool NsStepsInRange(int64_t x) { return x >= 1 && x <= 100; }

const std::vector<Field>& FieldsOf(OptimizerKind kind) {
  static const auto* const muon = new std::vector<Field>{
      DoubleField<MuonOptions>("lr", Muon, &MuonOptions::lr, NonNegative,
                               ">= 0"),
      DoubleField<MuonOptions>("momentum", Muon, &MuonOptions::momentum,
                               UnitInterval, "in [0, 1)"),
      BoolField<MuonOptions>("nesterov", Muon, &MuonOptions::nesterov),
      IntField<MuonOptions>("ns_steps", Muon, &MuonOptions::ns_steps,
                            NsStepsInRange, "in [1, 100]"),
      EnumField<MuonOptions, NsCoefficients>(
          "ns_coefficients", Muon, &MuonOptions::ns_coefficients,
          {NsCoefficients::kSimple, NsCoefficients::kQuintic,
           NsCoefficients::kPolarExpress},
          NsCoefficientsName),
      EnumField<MuonOptions, MuonScale>(
          "scale", Muon, &MuonOptions::scale,
          {MuonScale::kSpectral, MuonScale::kMatchRmsAdamW}, MuonScaleName),
      DoubleField<MuonOptions>("weight_decay", Muon, &MuonOptions::weight_decay,
                               NonNegative, ">= 0"),
      DoubleField<MuonOptions>("eps", Muon, &MuonOptions::eps, Positive, "> 0"),
      EnumField<MuonOptions, NsPrecisionOption>(
          "ns_precision", Muon, &MuonOptions::ns_precision,
          {NsPrecisionOption::kAuto, NsPrecisionOption::kFp32,
           NsPrecisionOption::kBf16},
          NsPrecisionOptionName),
      EnumField<MuonOptions, NsAlgorithm>(
          "ns_algorithm", Muon, &MuonOptions::ns_algorithm,
          {NsAlgorithm::kStandard, NsAlgorithm::kGram, NsAlgorithm::kAuto},
          NsAlgorithmOptionName),
  };
  static const auto* const adamw = new std::vector<Field>{
      DoubleField<AdamWOptions>("lr", AdamW, &AdamWOptions::lr, NonNegative,
                                ">= 0"),
      DoubleField<AdamWOptions>("beta1", AdamW, &AdamWOptions::beta1,
                                UnitInterval, "in [0, 1)"),
      DoubleField<AdamWOptions>("beta2", AdamW, &AdamWOptions::beta2,
                                UnitInterval, "in [0, 1)"),
      DoubleField<AdamWOptions>("eps", AdamW, &AdamWOptions::eps, Positive,
                                "> 0"),
      DoubleField<AdamWOptions>("weight_decay", AdamW,
                                &AdamWOptions::weight_decay, NonNegative,
                                ">= 0"),
  };
  static const auto* const shampoo = new std::vector<Field>{
      DoubleField<ShampooOptions>("lr", Shampoo, &ShampooOptions::lr,
                                  NonNegative, ">= 0"),
      DoubleField<ShampooOptions>("beta1", Shampoo, &ShampooOptions::beta1,
                                  UnitInterval, "in [0, 1)"),
      // beta2 == 1 (the default) is the plain sum of outer products.
      DoubleField<ShampooOptions>("beta2", Shampoo, &ShampooOptions::beta2,
                                  OpenClosedUnit, "in (0, 1]"),
      DoubleField<ShampooOptions>("epsilon", Shampoo, &ShampooOptions::epsilon,
                                  Positive, "> 0"),
      DoubleField<ShampooOptions>("weight_decay", Shampoo,
                                  &ShampooOptions::weight_decay, NonNegative,
                                  ">= 0"),
      IntField<ShampooOptions>("max_preconditioner_dim", Shampoo,
                               &ShampooOptions::max_preconditioner_dim,
                               AtLeastOne, ">= 1"),
      IntField<ShampooOptions>("precondition_frequency", Shampoo,
                               &ShampooOptions::precondition_frequency,
                               AtLeastOne, ">= 1"),
      IntField<ShampooOptions>(
          "start_preconditioning_step", Shampoo,
          &ShampooOptions::start_preconditioning_step,
          [](int64_t x) { return x == -1 || x >= 1; }, "-1 or >= 1"),
      EnumField<ShampooOptions, Grafting>(
          "grafting", Shampoo, &ShampooOptions::grafting,
          {Grafting::kAdam, Grafting::kAdagrad, Grafting::kNone}, GraftingName),
      // Adam grafting divides by 1 - grafting_beta2^t: 1 is excluded.
      DoubleField<ShampooOptions>("grafting_beta2", Shampoo,
                                  &ShampooOptions::grafting_beta2, UnitInterval,
                                  "in [0, 1)"),
      DoubleField<ShampooOptions>("grafting_epsilon", Shampoo,
                                  &ShampooOptions::grafting_epsilon, Positive,
                                  "> 0"),
  };
  static const auto* const soap = new std::vector<Field>{
      DoubleField<SoapOptions>("lr", Soap, &SoapOptions::lr, NonNegative,
                               ">= 0"),
      DoubleField<SoapOptions>("beta1", Soap, &SoapOptions::beta1, UnitInterval,
                               "in [0, 1)"),
      DoubleField<SoapOptions>("beta2", Soap, &SoapOptions::beta2, UnitInterval,
                               "in [0, 1)"),
      DoubleField<SoapOptions>(
          "shampoo_beta", Soap, &SoapOptions::shampoo_beta,
          [](double x) { return x == -1 || (x >= 0 && x < 1); },
          "-1 or in [0, 1)"),
      DoubleField<SoapOptions>("eps", Soap, &SoapOptions::eps, Positive, "> 0"),
      DoubleField<SoapOptions>("weight_decay", Soap, &SoapOptions::weight_decay,
                               NonNegative, ">= 0"),
      IntField<SoapOptions>("precondition_frequency", Soap,
                            &SoapOptions::precondition_frequency, AtLeastOne,
                            ">= 1"),
      IntField<SoapOptions>("max_precond_dim", Soap,
                            &SoapOptions::max_precond_dim, AtLeastOne, ">= 1"),
      BoolField<SoapOptions>("normalize_grads", Soap,
                             &SoapOptions::normalize_grads),
      BoolField<SoapOptions>("correct_bias", Soap, &SoapOptions::correct_bias),
  };
  switch (kind) {
    case OptimizerKind::kMuon:
      return *muon;
    case OptimizerKind::kAdamW:
      return *adamw;
    case OptimizerKind::kShampoo:
      return *shampoo;
    case OptimizerKind::kSoap:
      return *soap;
  }
  return *adamw;
}

}  // namespace

absl::string_view OptimizerKindName(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kMuon:
      return "muon";
    case OptimizerKind::kAdamW:
      return "adamw";
    case OptimizerKind::kShampoo:
      return "shampoo";
    case OptimizerKind::kSoap:
      return "soap";
  }
  return "unknown";
}

absl::StatusOr<OptimizerKind> ParseOptimizerKind(absl::string_view name) {
  for (OptimizerKind kind : {OptimizerKind::kMuon, OptimizerKind::kAdamW,
                             OptimizerKind::kShampoo, OptimizerKind::kSoap}) {
    if (OptimizerKindName(kind) == name) return kind;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("optimizer: unknown value \"", name,
                   "\" (expected muon, adamw, shampoo or soap)"));
}

absl::string_view NsCoefficientsName(NsCoefficients value) {
  switch (value) {
    case NsCoefficients::kSimple:
      return "simple";
    case NsCoefficients::kQuintic:
      return "quintic";
    case NsCoefficients::kPolarExpress:
      return "polar_express";
  }
  return "unknown";
}

absl::string_view MuonScaleName(MuonScale value) {
  switch (value) {
    case MuonScale::kSpectral:
      return "spectral";
    case MuonScale::kMatchRmsAdamW:
      return "match_rms_adamw";
  }
  return "unknown";
}

absl::string_view NsPrecisionOptionName(NsPrecisionOption value) {
  switch (value) {
    case NsPrecisionOption::kAuto:
      return "auto";
    case NsPrecisionOption::kFp32:
      return "fp32";
    case NsPrecisionOption::kBf16:
      return "bf16";
  }
  return "unknown";
}

absl::string_view NsAlgorithmOptionName(NsAlgorithm value) {
  return NsAlgorithmName(value);
}

absl::string_view GraftingName(Grafting value) {
  switch (value) {
    case Grafting::kAdam:
      return "adam";
    case Grafting::kAdagrad:
      return "adagrad";
    case Grafting::kNone:
      return "none";
  }
  return "unknown";
}

double ConfigLearningRate(const OptimizerConfig& config) {
  switch (config.kind) {
    case OptimizerKind::kMuon:
      return config.muon.lr;
    case OptimizerKind::kAdamW:
      return config.adamw.lr;
    case OptimizerKind::kShampoo:
      return config.shampoo.lr;
    case OptimizerKind::kSoap:
      return config.soap.lr;
  }
  return 0;
}

absl::StatusOr<std::vector<std::pair<std::string, std::string>>> ParseSettings(
    absl::string_view text) {
  std::vector<std::pair<std::string, std::string>> settings;
  if (absl::StripAsciiWhitespace(text).empty()) return settings;
  std::set<std::string> seen;
  for (absl::string_view item : absl::StrSplit(text, ',')) {
    absl::string_view trimmed = absl::StripAsciiWhitespace(item);
    size_t eq = trimmed.find('=');
    if (eq == absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat(
          "settings: \"", trimmed, "\" is not key=value (in \"", text, "\")"));
    }
    std::string key(absl::StripAsciiWhitespace(trimmed.substr(0, eq)));
    std::string value(absl::StripAsciiWhitespace(trimmed.substr(eq + 1)));
    if (key.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("settings: empty key in \"", trimmed, "\""));
    }
    if (value.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("setting ", key, ": empty value"));
    }
    if (!seen.insert(key).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("setting ", key, ": given twice"));
    }
    settings.emplace_back(std::move(key), std::move(value));
  }
  return settings;
}

absl::StatusOr<OptimizerConfig> MakeOptimizerConfig(
    OptimizerKind kind,
    const std::vector<std::pair<std::string, std::string>>& settings) {
  OptimizerConfig config;
  config.kind = kind;
  const std::vector<Field>& fields = FieldsOf(kind);
  for (const auto& [key, value] : settings) {
    const Field* found = nullptr;
    for (const Field& field : fields) {
      if (field.key == key) found = &field;
    }
    if (found == nullptr) {
      std::vector<std::string> known;
      for (const Field& field : fields) known.push_back(field.key);
      return absl::InvalidArgumentError(
          absl::StrCat("setting ", key, ": unknown hyperparameter for ",
                       OptimizerKindName(kind),
                       " (known: ", absl::StrJoin(known, ", "), ")"));
    }
    CANZONA_RETURN_IF_ERROR(found->set(value, config));
  }
  return config;
}

const std::vector<std::string>& ScheduledSettingNames(OptimizerKind kind) {
  static const auto* const muon =
      new std::vector<std::string>{"momentum", "weight_decay"};
  static const auto* const betas =
      new std::vector<std::string>{"beta1", "beta2", "eps", "weight_decay"};
  static const auto* const shampoo =
      new std::vector<std::string>{"beta1", "beta2", "epsilon", "weight_decay"};
  switch (kind) {
    case OptimizerKind::kMuon:
      return *muon;
    case OptimizerKind::kShampoo:
      return *shampoo;
    case OptimizerKind::kAdamW:
    case OptimizerKind::kSoap:
      break;
  }
  return *betas;
}

namespace {

const Field* FindField(OptimizerKind kind, absl::string_view key) {
  for (const Field& field : FieldsOf(kind)) {
    if (field.key == key) return &field;
  }
  return nullptr;
}

// The Fields of ScheduledSettingNames(kind), looked up once.
const std::vector<const Field*>& ScheduledFields(OptimizerKind kind) {
  static const auto* const fields = [] {
    constexpr OptimizerKind kKinds[] = {
        OptimizerKind::kMuon, OptimizerKind::kAdamW, OptimizerKind::kShampoo,
        OptimizerKind::kSoap};
    auto* by_kind = new std::map<OptimizerKind, std::vector<const Field*>>;
    for (OptimizerKind k : kKinds) {
      for (const std::string& key : ScheduledSettingNames(k)) {
        (*by_kind)[k].push_back(FindField(k, key));
      }
    }
    return by_kind;
  }();
  return fields->at(kind);
}

// Whether a rule created with `registered` has every state tensor that
// stepping with `scheduled` needs: Shampoo sizes its momentum at creation
// only where beta1 != 0 (a scheduled 0 with the buffer in place is fine:
// the momentum then equals the gradient).
bool KeepsItsState(const OptimizerConfig& registered,
                   const OptimizerConfig& scheduled) {
  return registered.kind != OptimizerKind::kShampoo ||
         registered.shampoo.beta1 != 0 || scheduled.shampoo.beta1 == 0;
}

}  // namespace

absl::StatusOr<OptimizerConfig> ScheduleSettings(
    const OptimizerConfig& registered,
    const std::map<std::string, double>& values) {
  const std::vector<std::string>& scheduled =
      ScheduledSettingNames(registered.kind);
  OptimizerConfig config = registered;
  for (const auto& [key, value] : values) {
    if (key == "lr") {
      return absl::InvalidArgumentError(
          "setting lr: a step's learning rate goes in StepRequest.lr");
    }
    if (std::find(scheduled.begin(), scheduled.end(), key) == scheduled.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "setting ", key, ": ", OptimizerKindName(registered.kind),
          " does not change it between steps (it may change ",
          absl::StrJoin(scheduled, ", "), "; others are set at Register)"));
    }
    // The registration's own parser and range check.
    CANZONA_RETURN_IF_ERROR(FindField(registered.kind, key)
                                ->set(std::isfinite(value)
                                          ? FormatDouble(value)
                                          : absl::StrCat(value),
                                      config));
  }
  if (!KeepsItsState(registered, config)) {
    return absl::InvalidArgumentError(
        "setting beta1: shampoo registered with beta1 0 keeps no momentum, "
        "so a step cannot turn it on (register with beta1 > 0 to schedule "
        "it)");
  }
  return config;
}

bool DifferOnlyInScheduled(const OptimizerConfig& a, const OptimizerConfig& b) {
  if (a.kind != b.kind || !KeepsItsState(a, b)) return false;
  OptimizerConfig aligned = b;
  for (const Field* field : ScheduledFields(a.kind)) field->copy(a, aligned);
  return aligned == a;
}

std::vector<std::pair<std::string, std::string>> ConfigSettings(
    const OptimizerConfig& config) {
  std::vector<std::pair<std::string, std::string>> settings;
  for (const Field& field : FieldsOf(config.kind)) {
    settings.emplace_back(field.key, field.get(config));
  }
  return settings;
}

}  // namespace canzona
