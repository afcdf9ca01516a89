// Optimizer kinds, their hyperparameters with the canonical defaults, and the
// "key=value,key=value" settings text users write (canzonactl --set, group
// registration).
//
// Defaults follow the public implementations named in server/DESIGN.md
// section 3, so users can move their learning rates over; the learning
// rates are Keller Jordan's Muon's (0.02), torch.optim.AdamW's (1e-3),
// Distributed Shampoo's (1e-2) and nikhilvyas/SOAP's (3e-3).
//
// Example:
//   CANZONA_ASSIGN_OR_RETURN(OptimizerKind kind, ParseOptimizerKind("muon"));
//   CANZONA_ASSIGN_OR_RETURN(auto settings,
//   ParseSettings("lr=0.02,nesterov=false"));
//   CANZONA_ASSIGN_OR_RETURN(OptimizerConfig config,
//                            MakeOptimizerConfig(kind, settings));
//
// Thread-safety: plain values and pure functions.
#ifndef CANZONA_SERVER_OPTIM_OPTIMIZER_CONFIG_H_
#define CANZONA_SERVER_OPTIM_OPTIMIZER_CONFIG_H_

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/ns_algorithm.h"

namespace canzona {

enum class OptimizerKind { kMuon, kAdamW, kShampoo, kSoap };

// "muon", "adamw", "shampoo", "soap".
absl::string_view OptimizerKindName(OptimizerKind kind);
// Inverse of OptimizerKindName; INVALID_ARGUMENT naming the value otherwise.
absl::StatusOr<OptimizerKind> ParseOptimizerKind(absl::string_view name);

// Muon's Newton-Schulz coefficient sets (see NewtonSchulzSpecFor).
enum class NsCoefficients { kSimple, kQuintic, kPolarExpress };
// How Muon scales the orthogonalized update.
enum class MuonScale { kSpectral, kMatchRmsAdamW };
// Newton-Schulz arithmetic: kAuto is bf16 on cuda, fp32 on cpu.
enum class NsPrecisionOption { kAuto, kFp32, kBf16 };
// Shampoo's grafting (the norm the preconditioned direction is given).
enum class Grafting { kAdam, kAdagrad, kNone };

struct MuonOptions {
  double lr = 0.02;
  double momentum = 0.95;
  bool nesterov = true;
  int64_t ns_steps = 5;
  NsCoefficients ns_coefficients = NsCoefficients::kSimple;
  MuonScale scale = MuonScale::kSpectral;
  double weight_decay = 0.0;
  double eps = 1e-7;
  NsPrecisionOption ns_precision = NsPrecisionOption::kAuto;
  // standard | gram | auto: auto picks gram per matrix where
  // kernels/ns_algorithm.h's cost rule predicts a win from the shape.
  NsAlgorithm ns_algorithm = NsAlgorithm::kAuto;
  bool operator==(const MuonOptions&) const = default;
};

struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
  bool operator==(const AdamWOptions&) const = default;
};

struct ShampooOptions {
  double lr = 1e-2;
  double beta1 = 0.9;
  double beta2 = 1.0;
  double epsilon = 1e-12;
  double weight_decay = 0.0;
  int64_t max_preconditioner_dim = 1024;
  int64_t precondition_frequency = 1;
  // -1 means precondition_frequency.
  int64_t start_preconditioning_step = -1;
  Grafting grafting = Grafting::kAdam;
  double grafting_beta2 = 0.999;
  double grafting_epsilon = 1e-8;
  bool operator==(const ShampooOptions&) const = default;
  // start_preconditioning_step with -1 resolved.
  int64_t start_step() const {
    return start_preconditioning_step == -1 ? precondition_frequency
                                            : start_preconditioning_step;
  }
};

struct SoapOptions {
  double lr = 3e-3;
  double beta1 = 0.95;
  double beta2 = 0.95;
  // -1 means beta2.
  double shampoo_beta = -1.0;
  double eps = 1e-8;
  double weight_decay = 0.01;
  int64_t precondition_frequency = 10;
  int64_t max_precond_dim = 10000;
  bool normalize_grads = false;
  bool correct_bias = true;
  bool operator==(const SoapOptions&) const = default;
  // shampoo_beta with -1 resolved.
  double resolved_shampoo_beta() const {
    return shampoo_beta < 0 ? beta2 : shampoo_beta;
  }
};

// The optimizer of one parameter group. Only the options of `kind` are used.
struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::kAdamW;
  MuonOptions muon;
  AdamWOptions adamw;
  ShampooOptions shampoo;
  SoapOptions soap;
  bool operator==(const OptimizerConfig&) const = default;
};

// The config's learning rate (the options of its kind).
double ConfigLearningRate(const OptimizerConfig& config);

// "lr=0.02,momentum=0.95" -> {{"lr", "0.02"}, {"momentum", "0.95"}} in
// order; whitespace around keys and values is dropped; "" -> {}.
// INVALID_ARGUMENT on an item without '=', an empty key or value, or a key
// given twice.
absl::StatusOr<std::vector<std::pair<std::string, std::string>>> ParseSettings(
    absl::string_view text);

// The defaults of `kind`, then each setting applied in order.
// INVALID_ARGUMENT naming the key for a key unknown to that optimizer, a
// malformed number / bool / enum, or an out-of-range value (lr < 0, betas
// outside [0, 1), eps <= 0, frequencies < 1, ...).
absl::StatusOr<OptimizerConfig> MakeOptimizerConfig(
    OptimizerKind kind,
    const std::vector<std::pair<std::string, std::string>>& settings);

// Every hyperparameter of config.kind as key/value strings, in a fixed
// order; numbers print in their shortest round-tripping form, so
// MakeOptimizerConfig(config.kind, ConfigSettings(config)) == config.
std::vector<std::pair<std::string, std::string>> ConfigSettings(
    const OptimizerConfig& config);

// The settings a trainer may change between steps (StepRequest.settings:
// torch.optim's param_groups edited by a schedule, Muon's momentum
// warm-up): those each step reads afresh and that size nothing. muon:
// momentum, weight_decay; adamw and soap: beta1, beta2, eps, weight_decay;
// shampoo: beta1, beta2, epsilon, weight_decay (beta1 only where it was
// registered > 0: at 0 the rule keeps no momentum to schedule).
const std::vector<std::string>& ScheduledSettingNames(OptimizerKind kind);

// `registered` with `values` applied for one step. INVALID_ARGUMENT naming
// the key for one that is not in ScheduledSettingNames(registered.kind) or
// a value out of the range MakeOptimizerConfig allows.
absl::StatusOr<OptimizerConfig> ScheduleSettings(
    const OptimizerConfig& registered,
    const std::map<std::string, double>& values);

// Whether `a` and `b` are one kind and differ at most in scheduled
// settings that a rule created with `a` can step with.
bool DifferOnlyInScheduled(const OptimizerConfig& a, const OptimizerConfig& b);

// Enum spellings used in settings text.
absl::string_view NsCoefficientsName(NsCoefficients value);
absl::string_view MuonScaleName(MuonScale value);
absl::string_view NsPrecisionOptionName(NsPrecisionOption value);
absl::string_view NsAlgorithmOptionName(NsAlgorithm value);
absl::string_view GraftingName(Grafting value);

}  // namespace canzona

#endif  // CANZONA_SERVER_OPTIM_OPTIMIZER_CONFIG_H_
