#include "server/optim/update_rule.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/base/status_macros.h"
#include "server/optim/rule_impl.h"

namespace canzona {

using optim_internal::MuonRule;
using optim_internal::RuleImpl;

const StateTensor* OptimizerState::FindTensor(absl::string_view name) const {
  for (const StateTensor& tensor : tensors) {
    if (tensor.name == name) return &tensor;
  }
  return nullptr;
}

int64_t NumElements(absl::Span<const int64_t> shape) {
  int64_t count = 1;
  for (int64_t dim : shape) count *= dim;
  return count;
}

absl::StatusOr<NewtonSchulzSpec> NewtonSchulzSpecFor(const MuonOptions& options,
                                                     BackendKind backend_kind) {
  NewtonSchulzSpec spec;
  const int64_t steps = options.ns_steps;
  switch (options.ns_coefficients) {
    case NsCoefficients::kSimple:
      spec.coefficients.assign(steps, {3.4445f, -4.7750f, 2.0315f});
      spec.norm_scale = 1.0f;
      spec.norm_eps = static_cast<float>(options.eps);
      break;
    case NsCoefficients::kQuintic: {
      static constexpr std::array<std::array<float, 3>, 5> kQuintic = {{
          {4.0848f, -6.8946f, 2.9270f},
          {3.9505f, -6.3029f, 2.6377f},
          {3.7418f, -5.5913f, 2.3037f},
          {2.8769f, -3.1427f, 1.2046f},
          {2.8366f, -3.0525f, 1.2012f},
      }};
      for (int64_t i = 0; i < steps; ++i) {
        spec.coefficients.push_back(kQuintic[i % kQuintic.size()]);
      }
      spec.norm_scale = 1.0f;
      spec.norm_eps = static_cast<float>(options.eps);
      break;
    }
    case NsCoefficients::kPolarExpress: {
      static constexpr std::array<std::array<double, 3>, 5> kPolar = {{
          {8.156554524902461, -22.48329292557795, 15.878769915207462},
          {4.042929935166739, -2.808917465908714, 0.5000178451051316},
          {3.8916678022926607, -2.772484153217685, 0.5060648178503393},
          {3.285753657755655, -2.3681294933425376, 0.46449024233003106},
          {2.3465413258596377, -1.7097828382687081, 0.42323551169305323},
      }};
      for (int64_t i = 0; i < steps; ++i) {
        const auto& c = kPolar[std::min<size_t>(i, kPolar.size() - 1)];
        spec.coefficients.push_back({static_cast<float>(c[0]),
                                     static_cast<float>(c[1]),
                                     static_cast<float>(c[2])});
      }
      // Polar Express's own safety margin: its first polynomial assumes
      // the spectral norm is at most 1, which ||X||_F only nearly bounds
      // after rounding.
      spec.norm_scale = 1.02f;
      spec.norm_eps = 1e-6f;
      break;
    }
  }
  switch (options.ns_precision) {
    case NsPrecisionOption::kAuto:
      spec.precision = backend_kind == BackendKind::kCuda
                           ? NsPrecision::kBfloat16
                           : NsPrecision::kFloat32;
      break;
    case NsPrecisionOption::kFp32:
      spec.precision = NsPrecision::kFloat32;
      break;
    case NsPrecisionOption::kBf16:
      if (backend_kind != BackendKind::kCuda) {
        return absl::InvalidArgumentError(
            "setting ns_precision: bf16 needs the cuda backend (cpu runs "
            "Newton-Schulz in fp32 only)");
      }
      spec.precision = NsPrecision::kBfloat16;
      break;
  }
  // kAuto stays kAuto: the backend resolves it per matrix shape (the same
  // rule the planner's cost model applies, kernels/ns_algorithm.h).
  spec.algorithm = options.ns_algorithm;
  return spec;
}

absl::StatusOr<SteppedMatrix> MatrixOfParameter(
    absl::Span<const int64_t> shape) {
  SteppedMatrix out;
  if (shape.size() == 2) {
    out.shape.assign(shape.begin(), shape.end());
  } else if (shape.size() == 3) {
    out.shape = {shape[0] * shape[1], shape[2]};
    out.blocks.dim = 0;
    out.blocks.sizes = {shape[1]};
    out.blocks.repeat = shape[0];
  } else if (shape.size() == 4 || shape.size() == 5) {
    int64_t columns = 1;
    for (size_t d = 1; d < shape.size(); ++d) columns *= shape[d];
    out.shape = {shape[0], columns};
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("needs a matrix (2-D, 3-D stacked matrices, or 4-D / 5-D "
                     "convolution filters), got a ",
                     shape.size(), "-D shape (use adamw)"));
  }
  return out;
}

UpdateRule::UpdateRule(const OptimizerConfig& config,
                       std::vector<int64_t> shape, Backend* backend,
                       std::unique_ptr<RuleImpl> impl)
    : config_(config),
      stepping_(config),
      shape_(std::move(shape)),
      backend_(backend),
      impl_(std::move(impl)) {}

UpdateRule::~UpdateRule() = default;

absl::StatusOr<std::unique_ptr<UpdateRule>> UpdateRule::Create(
    const OptimizerConfig& config, absl::Span<const int64_t> shape,
    Backend* backend, SharedScratch* scratch) {
  const absl::string_view name = OptimizerKindName(config.kind);
  if (backend == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": null backend"));
  }
  for (int64_t dim : shape) {
    if (dim < 1) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": shape [",
                                                     absl::StrJoin(shape, ", "),
                                                     "] has a dimension < 1"));
    }
  }
  if (config.kind != OptimizerKind::kAdamW && shape.size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, " needs a 2-D parameter, got shape [", absl::StrJoin(shape, ", "),
        "] (use adamw for other shapes)"));
  }
  if (scratch != nullptr) scratch->StartRule();
  std::unique_ptr<RuleImpl> impl;
  switch (config.kind) {
    case OptimizerKind::kMuon: {
      CANZONA_ASSIGN_OR_RETURN(
          impl,
          MuonRule::Create(config.muon, shape[0], shape[1], backend, scratch));
      break;
    }
    case OptimizerKind::kAdamW: {
      CANZONA_ASSIGN_OR_RETURN(
          impl, optim_internal::CreateAdamWRule(
                    config.adamw,
                    std::vector<int64_t>(shape.begin(), shape.end()), backend));
      break;
    }
    case OptimizerKind::kShampoo: {
      CANZONA_ASSIGN_OR_RETURN(
          impl, optim_internal::CreateShampooRule(config.shampoo, shape[0],
                                                  shape[1], backend, scratch));
      break;
    }
    case OptimizerKind::kSoap: {
      CANZONA_ASSIGN_OR_RETURN(
          impl, optim_internal::CreateSoapRule(config.soap, shape[0], shape[1],
                                               backend, scratch));
      break;
    }
  }
  return std::unique_ptr<UpdateRule>(
      new UpdateRule(config, std::vector<int64_t>(shape.begin(), shape.end()),
                     backend, std::move(impl)));
}

namespace {

absl::StatusOr<double> EffectiveLr(const OptimizerConfig& config,
                                   const StepOptions& options) {
  if (!options.lr.has_value()) return ConfigLearningRate(config);
  const float lr = *options.lr;
  if (!(lr >= 0.0f) || !std::isfinite(lr)) {
    return absl::InvalidArgumentError(
        absl::StrCat("step: lr override must be finite and >= 0, got ", lr));
  }
  return lr;
}

}  // namespace

absl::Status UpdateRule::Step(float* param, const float* grad,
                              const StepOptions& options) {
  if (options.change == SquaredChange::kQueue && !QueuesChange()) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.change: ", OptimizerKindName(config_.kind),
                     blocks_.empty() ? "" : " (blocked)",
                     " cannot queue its change in the pass that applies it"));
  }
  if (impl_ == nullptr) return StepBlocks(param, grad, options);
  CANZONA_ASSIGN_OR_RETURN(double lr, EffectiveLr(config_, options));
  CANZONA_RETURN_IF_ERROR(Settle(options));
  return impl_->Step(param, grad, lr, options.change);
}

absl::Status UpdateRule::Settle(const StepOptions& options) {
  const OptimizerConfig& wanted =
      options.settings != nullptr ? *options.settings : config_;
  if (wanted == stepping_) return absl::OkStatus();
  if (!DifferOnlyInScheduled(config_, wanted)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.settings: differ from the ", OptimizerKindName(config_.kind),
        " rule's config in more than the settings a step may change (",
        absl::StrJoin(ScheduledSettingNames(config_.kind), ", "), ")"));
  }
  impl_->Retune(wanted);
  stepping_ = wanted;
  return absl::OkStatus();
}

bool UpdateRule::QueuesChange() const {
  return impl_ != nullptr && impl_->queues_change();
}

absl::StatusOr<OptimizerState> UpdateRule::SaveState() const {
  if (impl_ != nullptr) return impl_->SaveState();
  std::vector<OptimizerState> states;
  for (const auto& rule : block_rules_) {
    CANZONA_ASSIGN_OR_RETURN(OptimizerState state, rule->SaveState());
    states.push_back(std::move(state));
  }
  return JoinBlockStates(config_.kind, std::move(states));
}

absl::Status UpdateRule::LoadState(const OptimizerState& state) {
  if (impl_ != nullptr) return impl_->LoadState(state);
  if (state.kind != config_.kind) {
    return absl::InvalidArgumentError(
        absl::StrCat("state holds ", OptimizerKindName(state.kind),
                     ", the rule is ", OptimizerKindName(config_.kind)));
  }
  // All blocks or none: a block that refuses its state puts the earlier
  // ones back.
  std::vector<OptimizerState> next = SplitBlockStates(state, blocks_.size());
  size_t names = state.counters.size() + state.tensors.size(), split = 0;
  for (const OptimizerState& s : next) {
    split += s.counters.size() + s.tensors.size();
  }
  if (split != names) {
    return absl::InvalidArgumentError(
        absl::StrCat("state: ", names - split,
                     " tensors or counters name no block of ", blocks_.size()));
  }
  std::vector<OptimizerState> before;
  for (size_t k = 0; k < block_rules_.size(); ++k) {
    CANZONA_ASSIGN_OR_RETURN(OptimizerState old, block_rules_[k]->SaveState());
    absl::Status loaded = block_rules_[k]->LoadState(next[k]);
    if (!loaded.ok()) {
      for (size_t j = 0; j < before.size(); ++j) {
        block_rules_[j]->LoadState(before[j]).IgnoreError();
      }
      return absl::Status(loaded.code(),
                          absl::StrCat("block ", k, " '", blocks_[k].name,
                                       "': ", loaded.message()));
    }
    before.push_back(std::move(old));
  }
  return absl::OkStatus();
}

int64_t UpdateRule::state_bytes() const {
  if (impl_ != nullptr) return impl_->state_bytes();
  int64_t bytes = 0;
  for (const auto& rule : block_rules_) bytes += rule->state_bytes();
  return bytes;
}

int64_t UpdateRule::own_bytes() const {
  if (impl_ != nullptr) return impl_->own_bytes();
  int64_t bytes = 0;
  for (const auto& rule : block_rules_) bytes += rule->own_bytes();
  return bytes;
}

// The batch's leader (rules[0]'s rule) when every rule is an unblocked
// `kind` rule that may step with it (the same options and backend; Muon
// also the same shape); INVALID_ARGUMENT naming the first that may not.
absl::StatusOr<optim_internal::RuleImpl*> CheckBatch(
    OptimizerKind kind, absl::Span<UpdateRule* const> rules) {
  const bool muon = kind == OptimizerKind::kMuon;
  const absl::string_view what = muon ? "Muon batch" : "AdamW batch";
  if (rules.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": no rules"));
  }
  const UpdateRule& first = *rules[0];
  for (size_t i = 0; i < rules.size(); ++i) {
    const UpdateRule& rule = *rules[i];
    if (rule.impl_ == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": rule ", i, " is blocked (it batches its own blocks)"));
    }
    if (rule.config_.kind != kind) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": rule ", i, " is ", OptimizerKindName(rule.config_.kind),
          ", not ", OptimizerKindName(kind)));
    }
    const bool same_options = muon ? rule.config_.muon == first.config_.muon
                                   : rule.config_.adamw == first.config_.adamw;
    if (!same_options || (muon && rule.shape_ != first.shape_) ||
        rule.backend_ != first.backend_) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": rule ", i, " differs from rule 0 in ",
          muon ? "config, shape or backend" : "config or backend"));
    }
  }
  return first.impl_.get();
}

namespace {

// StepMuonBatch's and StepAdamWBatch's arguments: one per rule.
absl::Status CheckBatchArguments(absl::string_view what, size_t rules,
                                 size_t params, size_t grads) {
  if (rules == params && rules == grads) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      what, ": ", rules, " rules, ", params, " params, ", grads, " grads"));
}

absl::StatusOr<MuonRule*> CheckMuonBatch(absl::Span<UpdateRule* const> rules) {
  CANZONA_ASSIGN_OR_RETURN(optim_internal::RuleImpl * leader,
                           CheckBatch(OptimizerKind::kMuon, rules));
  return static_cast<MuonRule*>(leader);
}

}  // namespace

absl::Status ReserveMuonBatch(absl::Span<UpdateRule* const> rules) {
  if (rules.size() < 2) return absl::OkStatus();
  CANZONA_ASSIGN_OR_RETURN(MuonRule * leader,
                           CheckMuonBatch(rules));
  const int64_t rows = rules[0]->shape()[0];
  const int64_t cols = rules[0]->shape()[1];
  const int64_t batch = static_cast<int64_t>(rules.size());
  CANZONA_RETURN_IF_ERROR(leader->BatchScratch(batch * rows * cols).status());
  return rules[0]->backend()->ReserveNewtonSchulz(leader->spec(), batch, rows,
                                                  cols);
}

absl::Status StepMuonBatch(absl::Span<UpdateRule* const> rules,
                           absl::Span<float* const> params,
                           absl::Span<const float* const> grads,
                           const StepOptions& options) {
  CANZONA_RETURN_IF_ERROR(CheckBatchArguments("StepMuonBatch", rules.size(),
                                              params.size(), grads.size()));
  if (rules.empty()) return absl::OkStatus();
  CANZONA_ASSIGN_OR_RETURN(MuonRule * leader,
                           CheckMuonBatch(rules));
  const UpdateRule& first = *rules[0];
  CANZONA_ASSIGN_OR_RETURN(double lr, EffectiveLr(first.config_, options));
  for (UpdateRule* rule : rules) CANZONA_RETURN_IF_ERROR(rule->Settle(options));
  const int64_t rows = first.shape_[0];
  const int64_t cols = first.shape_[1];
  const int64_t numel = rows * cols;
  const int64_t batch = static_cast<int64_t>(rules.size());
  CANZONA_ASSIGN_OR_RETURN(float* work, leader->BatchScratch(batch * numel));
  for (int64_t i = 0; i < batch; ++i) {
    auto* muon = static_cast<MuonRule*>(rules[i]->impl_.get());
    CANZONA_RETURN_IF_ERROR(muon->UpdateMomentum(grads[i], work + i * numel));
  }
  CANZONA_RETURN_IF_ERROR(first.backend_->NewtonSchulz(leader->spec(), batch,
                                                       rows, cols, work, work));
  for (int64_t i = 0; i < batch; ++i) {
    auto* muon = static_cast<MuonRule*>(rules[i]->impl_.get());
    CANZONA_RETURN_IF_ERROR(
        muon->ApplyUpdate(params[i], work + i * numel, lr, options.change));
  }
  return absl::OkStatus();
}

absl::Status StepAdamWBatch(absl::Span<UpdateRule* const> rules,
                            absl::Span<float* const> params,
                            absl::Span<const float* const> grads,
                            const StepOptions& options) {
  CANZONA_RETURN_IF_ERROR(CheckBatchArguments("StepAdamWBatch", rules.size(),
                                              params.size(), grads.size()));
  if (rules.empty()) return absl::OkStatus();
  CANZONA_RETURN_IF_ERROR(CheckBatch(OptimizerKind::kAdamW, rules).status());
  const UpdateRule& first = *rules[0];
  auto adamw = [&](size_t i) {
    return static_cast<optim_internal::AdamWRule*>(rules[i]->impl_.get());
  };
  const int64_t step = adamw(0)->next_step();
  for (size_t i = 1; i < rules.size(); ++i) {
    if (adamw(i)->next_step() == step) continue;
    for (size_t j = 0; j < rules.size(); ++j) {
      CANZONA_RETURN_IF_ERROR(rules[j]->Step(params[j], grads[j], options));
    }
    return absl::OkStatus();
  }
  CANZONA_ASSIGN_OR_RETURN(double lr, EffectiveLr(first.config_, options));
  for (UpdateRule* rule : rules) CANZONA_RETURN_IF_ERROR(rule->Settle(options));
  std::vector<Backend::AdamWTensor> tensors;
  tensors.reserve(rules.size());
  for (size_t i = 0; i < rules.size(); ++i) {
    tensors.push_back(adamw(i)->BeginStep(params[i], grads[i]));
  }
  const AdamWOptions& o = adamw(0)->options();
  return first.backend_->AdamWStepMany(
      tensors, static_cast<float>(lr), static_cast<float>(o.beta1),
      static_cast<float>(o.beta2), static_cast<float>(o.eps),
      static_cast<float>(o.weight_decay), step, options.change);
}

}  // namespace canzona
