// Muon (torch.optim.Muon / Keller Jordan): momentum, Newton-Schulz
// orthogonalization, shape-dependent scale, decoupled weight decay.
#include <algorithm>
#include <cmath>

#include "kernels/base/status_macros.h"
#include "server/optim/rule_impl.h"

namespace canzona::optim_internal {

MuonRule::MuonRule(const MuonOptions& options, int64_t rows, int64_t cols,
                   NewtonSchulzSpec spec, Backend* backend)
    : RuleImpl(OptimizerKind::kMuon, backend),
      options_(options),
      rows_(rows),
      cols_(cols),
      spec_(std::move(spec)) {
  // Rows and cols are the whole matrix's, so a sharded parameter gets the
  // scale of its global shape.
  const double r = static_cast<double>(rows);
  const double c = static_cast<double>(cols);
  scale_ = options.scale == MuonScale::kSpectral
               ? std::sqrt(std::max(1.0, r / c))
               : 0.2 * std::sqrt(std::max(r, c));
}

absl::StatusOr<std::unique_ptr<MuonRule>> MuonRule::Create(
    const MuonOptions& options, int64_t rows, int64_t cols, Backend* backend,
    SharedScratch* scratch) {
  CANZONA_ASSIGN_OR_RETURN(NewtonSchulzSpec spec,
                           NewtonSchulzSpecFor(options, backend->kind()));
  std::unique_ptr<MuonRule> rule(
      new MuonRule(options, rows, cols, std::move(spec), backend));
  CANZONA_ASSIGN_OR_RETURN(rule->momentum_,
                           rule->AddState("momentum", {rows, cols}));
  rule->ShareScratch(scratch);
  CANZONA_ASSIGN_OR_RETURN(rule->work_, rule->AddScratch(rows * cols));
  // The backend's Newton-Schulz workspace, now rather than in a step.
  CANZONA_RETURN_IF_ERROR(
      backend->ReserveNewtonSchulz(rule->spec_, 1, rows, cols));
  return rule;
}

absl::Status MuonRule::UpdateMomentum(const float* grad, float* out) {
  const int64_t n = rows_ * cols_;
  const float momentum = static_cast<float>(options_.momentum);
  if (options_.nesterov) {
    CANZONA_RETURN_IF_ERROR(
        backend_->NesterovMomentum(n, momentum, grad, momentum_, out));
  } else {
    CANZONA_RETURN_IF_ERROR(
        backend_->Lerp(n, momentum_, grad, 1.0f - momentum, momentum_));
    CANZONA_RETURN_IF_ERROR(backend_->Copy(momentum_, n, out));
  }
  ++step_;
  return absl::OkStatus();
}

absl::Status MuonRule::ApplyUpdate(float* param, const float* orthogonalized,
                                   double lr, SquaredChange change) {
  return backend_->Axpby(
      rows_ * cols_, static_cast<float>(-lr * scale_), orthogonalized,
      static_cast<float>(1.0 - lr * options_.weight_decay), param, change);
}

absl::Status MuonRule::Step(float* param, const float* grad, double lr,
                            SquaredChange change) {
  CANZONA_RETURN_IF_ERROR(UpdateMomentum(grad, work_));
  CANZONA_RETURN_IF_ERROR(
      backend_->NewtonSchulz(spec_, 1, rows_, cols_, work_, work_));
  return ApplyUpdate(param, work_, lr, change);
}

absl::StatusOr<float*> MuonRule::BatchScratch(int64_t count) {
  if (batch_scratch_.size() < count) {
    CANZONA_ASSIGN_OR_RETURN(batch_scratch_, backend_->Allocate(count));
  }
  return batch_scratch_.data();
}

}  // namespace canzona::optim_internal
