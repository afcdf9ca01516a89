// AdamW (torch.optim.AdamW, single-tensor path) on any shape: one fused
// backend kernel per step, or one backend call for a batch of tensors
// (StepAdamWBatch).
#include "kernels/base/status_macros.h"
#include "server/optim/rule_impl.h"

namespace canzona::optim_internal {

AdamWRule::AdamWRule(const AdamWOptions& options, std::vector<int64_t> shape,
                     Backend* backend)
    : RuleImpl(OptimizerKind::kAdamW, backend),
      options_(options),
      shape_(std::move(shape)),
      numel_(NumElements(shape_)) {}

absl::Status AdamWRule::Init() {
  CANZONA_ASSIGN_OR_RETURN(exp_avg_, AddState("exp_avg", shape_));
  CANZONA_ASSIGN_OR_RETURN(exp_avg_sq_, AddState("exp_avg_sq", shape_));
  return absl::OkStatus();
}

absl::Status AdamWRule::Step(float* param, const float* grad, double lr,
                             SquaredChange change) {
  const Backend::AdamWTensor t = BeginStep(param, grad);
  return backend_->AdamWStep(
      t.n, static_cast<float>(lr), static_cast<float>(options_.beta1),
      static_cast<float>(options_.beta2), static_cast<float>(options_.eps),
      static_cast<float>(options_.weight_decay), step_, t.g, t.p, t.m, t.v,
      change);
}

Backend::AdamWTensor AdamWRule::BeginStep(float* param, const float* grad) {
  ++step_;
  return {numel_, grad, param, exp_avg_, exp_avg_sq_};
}

absl::StatusOr<std::unique_ptr<RuleImpl>> CreateAdamWRule(
    const AdamWOptions& options, std::vector<int64_t> shape, Backend* backend) {
  auto rule = std::make_unique<AdamWRule>(options, std::move(shape), backend);
  CANZONA_RETURN_IF_ERROR(rule->Init());
  return rule;
}

}  // namespace canzona::optim_internal
